"""hf_fsdp2.checkpoint.safetensors_io against the real `safetensors` library, in one process.

Several `FileWriter`s on one file stand in for ranks (each writes its own dim-0 row blocks, exactly as a
rank of an FSDP2 group would); files are checked with `safetensors.torch.load_file` / `safe_open`, and
the mirror (files from `save_file` read by `read_layout` + `read_rows`). A deterministic fuzz over
corrupted files checks that `read_layout` refuses with a `CheckpointError` naming the file (and the
tensor), or accepts only what `safetensors` accepts too.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import random
import signal
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import hf_fsdp2.checkpoint.safetensors_io as sio
from hf_fsdp2.checkpoint.safetensors_io import (
    CheckpointError, CheckpointFiles, FileWriter, TensorSpec, parse_size, plan_checkpoint, plan_file, read_index,
    read_layout, read_rows, write_json,
)

# ---------------------------------------------------------------------------------------------
# Helpers


def chunk_ranges(rows: int, world: int) -> list[tuple[int, int]]:
    """Row range of each rank under FSDP2's `torch.chunk` dim-0 sharding (trailing ranks may be empty)."""
    per = math.ceil(rows / world) if rows else 0
    return [(min(r * per, rows), min((r + 1) * per, rows)) for r in range(world)]


def test_chunk_ranges_match_torch_chunk():
    for rows in range(0, 12):
        for world in range(1, 6):
            sizes = [c.shape[0] for c in torch.chunk(torch.empty(rows, 1), world)] if rows else []
            sizes += [0] * (world - len(sizes))
            assert [b - a for a, b in chunk_ranges(rows, world)] == sizes, (rows, world)


def assert_same(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    assert actual.dtype == expected.dtype, (what, actual.dtype, expected.dtype)
    assert tuple(actual.shape) == tuple(expected.shape), (what, actual.shape, expected.shape)
    assert torch.equal(actual, expected), what


def specs_of(tensors: dict[str, torch.Tensor]) -> list[TensorSpec]:
    return [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]


def rows_of(t: torch.Tensor) -> int:
    return t.shape[0] if t.dim() else 1


def write_ranks(path: Path, layout, tensors: dict[str, torch.Tensor], ranges_of, *, creator: int,
                open_order: list[int], sequential: bool) -> None:
    """Write `tensors` with one FileWriter per rank; `ranges_of(name, rank)` gives each rank's rows.

    `sequential`: each rank opens, writes and closes before the next opens (so ranks before the creator
    write into a file with no header yet); otherwise all open first, then write in reverse order.
    """
    def write(rank: int, writer: FileWriter) -> None:
        for name, t in tensors.items():
            a, b = ranges_of(name, rank)
            if b > a:
                block = t[a:b] if t.dim() else t
                assert writer.write_rows(name, a, block) == block.numel() * t.dtype.itemsize

    if sequential:
        for rank in open_order:
            with FileWriter(path, layout, create=rank == creator) as w:
                write(rank, w)
    else:
        writers = {rank: FileWriter(path, layout, create=rank == creator) for rank in open_order}
        for rank in reversed(open_order):
            write(rank, writers[rank])
        for w in writers.values():
            w.close()


def mixed_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed.weight": torch.randn(7, 3, generator=g),
        "model.norm.bias": torch.randn(5, generator=g).to(torch.bfloat16),
        "half": torch.randn(4, 2, 2, generator=g).to(torch.float16),
        "ids": torch.randint(-2**40, 2**40, (6,), generator=g, dtype=torch.int64),
        "mask": torch.rand(6, 2, generator=g) > 0.5,
        "scalar": torch.tensor(3.25),
        "step": torch.tensor(123456789012, dtype=torch.int64),
        "no_rows": torch.empty(0, 4),
        "no_cols": torch.empty(3, 0, dtype=torch.bfloat16),
        "one_row": torch.randn(1, 9, generator=g).double(),
        "λ.weight": torch.randn(2, 2, generator=g),  # non-ASCII name: \u-escaped in our JSON header
    }


def check_file_holds(path: Path, tensors: dict[str, torch.Tensor], world: int) -> None:
    """`path` loads, with the real safetensors library, to exactly `tensors`, whole and by row blocks."""
    loaded = load_file(path)
    assert loaded.keys() == tensors.keys()
    for name, t in tensors.items():
        assert_same(loaded[name], t, name)
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "pt"}
        for name, t in tensors.items():
            if t.dim() == 0:  # a 0-dim slice cannot be indexed
                assert f.get_slice(name).get_shape() == []
                assert_same(f.get_tensor(name), t, name)
                continue
            for a, b in chunk_ranges(t.shape[0], world):
                assert_same(f.get_slice(name)[a:b], t[a:b], f"{name}[{a}:{b}]")


# ---------------------------------------------------------------------------------------------
# 1. Round trips: FileWriter -> safetensors, and save_file -> read_layout / read_rows


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("creator_pos", ["first", "last"])
@pytest.mark.parametrize("sequential", [False, True], ids=["all-open", "one-after-another"])
def test_several_writers_one_file_load_with_safetensors(tmp_path, world, creator_pos, sequential):
    tensors = mixed_tensors()
    path = tmp_path / "model.safetensors"
    layout = plan_file(path.name, specs_of(tensors))
    order = list(range(world)) if creator_pos == "first" else list(range(1, world)) + [0]

    def ranges(name, rank):
        t = tensors[name]
        if t.dim() == 0:  # a scalar is written by one rank: the last to open, never the creator if possible
            return (0, 1) if rank == order[-1] else (0, 0)
        return chunk_ranges(t.shape[0], world)[rank]

    write_ranks(path, layout, tensors, ranges, creator=0, open_order=order, sequential=sequential)
    assert path.stat().st_size == layout.size
    check_file_holds(path, tensors, world)
    # Our reader sees exactly the planned layout and the same rows.
    assert read_layout(path) == layout
    for name, t in tensors.items():
        if t.dim() == 0:  # a scalar is rows [0, 1)
            assert_same(read_rows(path, layout, name, 0, 1), t, name)
            continue
        for a, b in chunk_ranges(t.shape[0], world):
            assert_same(read_rows(path, layout, name, a, b), t[a:b], name)


@pytest.mark.parametrize("split", [(4, 3, 0), (0, 7, 0), (1, 0, 6), (0, 0, 7), (3, 3, 1)])
def test_uneven_row_splits(tmp_path, split):
    assert sum(split) == 7
    tensors = {"w": torch.arange(7 * 5, dtype=torch.float32).reshape(7, 5),
               "b": torch.arange(7, dtype=torch.int64) * -3}
    bounds = [sum(split[:r]) for r in range(len(split) + 1)]
    path = tmp_path / "m.safetensors"
    layout = plan_file(path.name, specs_of(tensors))
    write_ranks(path, layout, tensors, lambda name, rank: (bounds[rank], bounds[rank + 1]),
                creator=2, open_order=[0, 1, 2], sequential=True)
    check_file_holds(path, tensors, 3)
    with safe_open(path, "pt") as f:
        for r in range(3):
            assert_same(f.get_slice("w")[bounds[r]:bounds[r + 1]], tensors["w"][bounds[r]:bounds[r + 1]])


@pytest.mark.parametrize("chunk_bytes", [1, 8, 64, 1000])
def test_blocks_larger_than_write_chunk(tmp_path, monkeypatch, chunk_bytes):
    monkeypatch.setattr(sio, "WRITE_CHUNK_BYTES", chunk_bytes)
    writes = []
    real_pwrite_all = sio._pwrite_all

    def spy(fd, data, offset, path):
        writes.append(len(data))
        return real_pwrite_all(fd, data, offset, path)

    monkeypatch.setattr(sio, "_pwrite_all", spy)
    g = torch.Generator().manual_seed(1)
    full = torch.randn(50, 7, generator=g)
    tensors = {"big": full, "big16": full.to(torch.bfloat16)[:, :3].contiguous()}
    path = tmp_path / "m.safetensors"
    layout = plan_file(path.name, specs_of(tensors))
    write_ranks(path, layout, tensors, lambda name, rank: chunk_ranges(50, 2)[rank],
                creator=0, open_order=[0, 1], sequential=False)
    check_file_holds(path, tensors, 2)
    data_writes = writes[1:]  # the first is the header
    row_bytes = max(s.row_bytes for s in layout.specs.values())  # 28
    # Never more than one chunk at once (or one row, when a row is larger than a chunk).
    assert max(data_writes) <= max(chunk_bytes, row_bytes)
    assert len(data_writes) >= sum(s.nbytes for s in layout.specs.values()) // max(chunk_bytes, row_bytes)


@pytest.mark.parametrize("src,dst", [(torch.float32, torch.bfloat16), (torch.float32, torch.float16),
                                     (torch.bfloat16, torch.float32), (torch.float64, torch.float32),
                                     (torch.int64, torch.int32)])
def test_write_casts_to_the_planned_dtype(tmp_path, src, dst):
    g = torch.Generator().manual_seed(2)
    block = (torch.randn(6, 4, generator=g) * 100).to(src)
    path = tmp_path / "m.safetensors"
    layout = plan_file(path.name, [TensorSpec("w", dst, (6, 4))])
    with FileWriter(path, layout, create=True) as w:
        assert w.write_rows("w", 0, block[:4]) == 4 * 4 * dst.itemsize
    with FileWriter(path, layout, create=False) as w:
        w.write_rows("w", 4, block[4:])
    assert_same(load_file(path)["w"], block.to(dst))


def test_converted_chunks_go_through_one_reused_staging_buffer(tmp_path, monkeypatch):
    """Rows that are not already host rows in the file dtype (a cast here; a GPU shard there) are copied into
    one buffer per writer, reused chunk after chunk and tensor after tensor: fresh host tensors per chunk
    made a 4.94 GB save on the H200 run at 0.51x the disk. Rows already right are written from themselves."""
    monkeypatch.setattr(sio, "WRITE_CHUNK_BYTES", 64)  # 8 bf16 rows of 4 per chunk
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(20, 4, generator=g), torch.randn(9, 4, generator=g)
    plain = torch.randn(5, 4, generator=g).to(torch.bfloat16)
    path = tmp_path / "m.safetensors"
    layout = plan_file(path.name, [TensorSpec("a", torch.bfloat16, (20, 4)), TensorSpec("b", torch.bfloat16, (9, 4)),
                                   TensorSpec("c", torch.bfloat16, (5, 4))])
    with FileWriter(path, layout, create=True) as w:
        w.write_rows("a", 0, a)
        staging = w._staging.data_ptr()
        w.write_rows("b", 0, b.t().contiguous().t())  # non-contiguous rows too
        w.write_block("c", 0, None, plain)
        assert w._staging.data_ptr() == staging and w._staging.numel() == 64
    out = load_file(path)
    assert_same(out["a"], a.to(torch.bfloat16))
    assert_same(out["b"], b.to(torch.bfloat16))
    assert_same(out["c"], plain)


def test_non_contiguous_block(tmp_path):
    full = torch.arange(21, dtype=torch.float32).reshape(3, 7).t()  # (7, 3), not contiguous
    assert not full.is_contiguous()
    path = tmp_path / "m.safetensors"
    layout = plan_file(path.name, [TensorSpec("w", torch.float32, (7, 3))])
    with FileWriter(path, layout, create=True) as w:
        w.write_rows("w", 0, full[:4])
        w.write_rows("w", 4, full[4:])
    assert_same(load_file(path)["w"], full.contiguous())


def test_creator_shrinks_a_stale_larger_file(tmp_path):
    path = tmp_path / "m.safetensors"
    path.write_bytes(b"\xff" * 4096)  # a previous, bigger save left here
    tensors = {"w": torch.randn(4, 4)}
    layout = plan_file(path.name, specs_of(tensors))
    write_ranks(path, layout, tensors, lambda name, rank: chunk_ranges(4, 2)[rank],
                creator=1, open_order=[0, 1], sequential=False)
    assert path.stat().st_size == layout.size
    check_file_holds(path, tensors, 2)


def test_empty_file_and_custom_metadata(tmp_path):
    path = tmp_path / "e.safetensors"
    layout = plan_file(path.name, [])
    FileWriter(path, layout, create=True).close()
    assert load_file(path) == {}
    assert read_layout(path) == layout
    path2 = tmp_path / "m.safetensors"
    layout2 = plan_file(path2.name, [TensorSpec("a", torch.float32, (1,))], metadata={"format": "pt", "k": "v"})
    with FileWriter(path2, layout2, create=True) as w:
        w.write_rows("a", 0, torch.ones(1))
    with safe_open(path2, "pt") as f:
        assert f.metadata() == {"format": "pt", "k": "v"}


def test_plan_file_refuses_duplicates_and_unknown_dtypes():
    with pytest.raises(ValueError, match="twice"):
        plan_file("x.safetensors", [TensorSpec("a", torch.float32, (1,)), TensorSpec("a", torch.float32, (1,))])
    with pytest.raises(ValueError, match="twice"):
        plan_file("x.safetensors", [TensorSpec("__metadata__", torch.float32, (1,))])
    with pytest.raises(TypeError, match="complex64"):
        plan_file("x.safetensors", [TensorSpec("a", torch.complex64, (1,))])


def test_plan_is_deterministic_and_aligned():
    tensors = mixed_tensors()
    a = plan_file("m.safetensors", specs_of(tensors))
    b = plan_file("m.safetensors", specs_of(mixed_tensors(seed=5)))
    assert a == b
    assert len(a.header) % 8 == 0 and struct.unpack("<Q", a.header[:8])[0] == len(a.header) - 8


def saved_by_safetensors(tmp_path) -> tuple[Path, dict[str, torch.Tensor]]:
    tensors = mixed_tensors(seed=3)
    path = tmp_path / "model.safetensors"
    save_file(tensors, path, metadata={"format": "pt"})
    return path, tensors


def test_read_safetensors_file_by_row_blocks(tmp_path):
    path, tensors = saved_by_safetensors(tmp_path)
    layout = read_layout(path)
    assert layout.filename == path.name and layout.size == path.stat().st_size
    assert {n: (s.dtype, s.shape) for n, s in layout.specs.items()} == {
        n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()}
    for name, t in tensors.items():
        if t.dim() == 0:
            assert_same(read_rows(path, layout, name, 0, 1), t, name)
            continue
        blocks = [read_rows(path, layout, name, a, b) for a, b in chunk_ranges(t.shape[0], 3)]
        assert_same(torch.cat(blocks), t, name)


def test_read_rows_into_out(tmp_path):
    path, tensors = saved_by_safetensors(tmp_path)
    layout = read_layout(path)
    for name, t in tensors.items():
        a, b = chunk_ranges(t.shape[0], 2)[-1] if t.dim() else (0, 1)
        expected = t[a:b] if t.dim() else t
        # Same dtype: read straight into `out`, which is returned.
        out = torch.full_like(expected, 7) if expected.dtype != torch.bool else torch.ones_like(expected)
        assert read_rows(path, layout, name, a, b, out=out) is out
        assert_same(out, expected, name)
        # Another dtype: cast on the way in.
        other = torch.float64 if t.dtype != torch.float64 else torch.float32
        out2 = torch.zeros(expected.shape, dtype=other)
        assert read_rows(path, layout, name, a, b, out=out2) is out2
        assert_same(out2, expected.to(other), name)


def test_read_rows_into_non_contiguous_out(tmp_path):
    path, tensors = saved_by_safetensors(tmp_path)
    layout = read_layout(path)
    t = tensors["model.embed.weight"]  # (7, 3)
    holder = torch.zeros(3, 7)
    out = holder.t()[2:6]  # (4, 3) view, not contiguous
    assert not out.is_contiguous()
    assert read_rows(path, layout, "model.embed.weight", 2, 6, out=out) is out
    assert_same(holder.t()[2:6], t[2:6])
    assert torch.count_nonzero(holder.t()[:2]) == 0 and torch.count_nonzero(holder.t()[6:]) == 0


def test_read_rows_refuses_bad_requests(tmp_path):
    path, tensors = saved_by_safetensors(tmp_path)
    layout = read_layout(path)
    for a, b in [(0, 8), (-1, 2), (5, 4), (8, 8)]:
        with pytest.raises(CheckpointError) as e:
            read_rows(path, layout, "model.embed.weight", a, b)
        assert str(path) in str(e.value) and "model.embed.weight" in str(e.value)
    for a, b in [(0, 2), (1, 1), (0, 0)]:  # a scalar is rows [0, 1), nothing else
        with pytest.raises(CheckpointError, match="scalar"):
            read_rows(path, layout, "scalar", a, b)
    with pytest.raises(CheckpointError) as e:
        read_rows(path, layout, "nope", 0, 1)
    assert str(path) in str(e.value) and "nope" in str(e.value)
    # `out` of the wrong shape is refused (copy_ would otherwise broadcast) and left untouched.
    for dtype in (torch.float32, torch.float64):
        for out_rows, (a, b) in [(1, (0, 4)), (4, (0, 1)), (3, (0, 4))]:
            out = torch.zeros(out_rows, 3, dtype=dtype)
            with pytest.raises(ValueError, match="`out`"):
                read_rows(path, layout, "model.embed.weight", a, b, out=out)
            assert torch.count_nonzero(out) == 0
    # Zero rows: an empty tensor of the right shape, no file access needed.
    assert read_rows(path, layout, "model.embed.weight", 3, 3).shape == (0, 3)
    assert read_rows(path, layout, "no_rows", 0, 0).shape == (0, 4)


def test_read_rows_on_a_file_truncated_after_its_header_was_read(tmp_path):
    path, tensors = saved_by_safetensors(tmp_path)
    layout = read_layout(path)
    name = max(layout.specs, key=lambda n: layout.begins[n] + layout.specs[n].nbytes)  # ends the file
    spec = layout.specs[name]
    with open(path, "r+b") as f:
        f.truncate(layout.size - 1)
    with pytest.raises(CheckpointError) as e:
        read_rows(path, layout, name, 0, spec.shape[0] if spec.shape else 1)
    assert str(path) in str(e.value) and name in str(e.value)


def test_checkpoint_files_single_file(tmp_path):
    path, tensors = saved_by_safetensors(tmp_path)
    files = CheckpointFiles(tmp_path)
    assert set(files.names()) == set(tensors)
    for name, t in tensors.items():
        assert files.spec(name) == TensorSpec(name, t.dtype, tuple(t.shape))
        assert_same(files.read(name), t, name)
        if t.dim() and t.shape[0] > 1:
            assert_same(files.read_rows(name, 1, t.shape[0]), t[1:], name)


# ---------------------------------------------------------------------------------------------
# 2. plan_checkpoint and parse_size


def test_plan_checkpoint_single_file():
    specs = specs_of(mixed_tensors())
    layouts, index = plan_checkpoint(specs)
    assert index is None and [l.filename for l in layouts] == ["model.safetensors"]
    assert list(layouts[0].specs) == [s.name for s in specs]


def sized_specs(sizes: list[int]) -> list[TensorSpec]:
    return [TensorSpec(f"layers.{i}.weight", torch.float32, (n,)) for i, n in enumerate(sizes)]


def test_plan_checkpoint_shards_like_the_hub_splitter():
    """transformers' save_pretrained shards with huggingface_hub.split_torch_state_dict_into_shards."""
    hub = pytest.importorskip("huggingface_hub")
    rng = random.Random(0)
    for trial in range(30):
        limit_elems = rng.randint(4, 40)
        sizes = [rng.randint(1, limit_elems) for _ in range(rng.randint(1, 25))]  # none larger than the limit
        specs = sized_specs(sizes)
        limit = 4 * limit_elems
        layouts, index = plan_checkpoint(specs, limit)
        split = hub.split_torch_state_dict_into_shards({s.name: torch.zeros(s.shape) for s in specs},
                                                       max_shard_size=limit)
        assert {l.filename: list(l.specs) for l in layouts} == split.filename_to_tensors, trial
        if index is None:
            assert not split.is_sharded
            assert layouts[0].filename == "model.safetensors"
            continue
        assert index == {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        n = len(layouts)
        assert [l.filename for l in layouts] == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
        assert index["metadata"]["total_size"] == 4 * sum(sizes)
        for layout in layouts:
            assert sum(s.nbytes for s in layout.specs.values()) <= limit


def test_plan_checkpoint_oversized_tensor_gets_its_own_file():
    # Order is kept: [a][B][c]. (huggingface_hub would emit [B][a, c]; both are valid checkpoints.)
    specs = [TensorSpec("a", torch.float32, (2,)), TensorSpec("B", torch.float32, (100,)),
             TensorSpec("c", torch.float32, (2,))]
    layouts, index = plan_checkpoint(specs, "40B")
    assert [list(l.specs) for l in layouts] == [["a"], ["B"], ["c"]]
    assert index["weight_map"] == {"a": "model-00001-of-00003.safetensors", "B": "model-00002-of-00003.safetensors",
                                   "c": "model-00003-of-00003.safetensors"}
    layouts, _ = plan_checkpoint(specs, 1000, weights_name="adapter_model.safetensors")
    assert [l.filename for l in layouts] == ["adapter_model.safetensors"]
    layouts, _ = plan_checkpoint(specs, 8, weights_name="adapter_model.safetensors")
    assert layouts[0].filename == "adapter_model-00001-of-00003.safetensors"


def test_sharded_checkpoint_matches_transformers_save_pretrained(tmp_path):
    """Same files and index as transformers' own sharded save; each side loads the other's checkpoint."""
    transformers = pytest.importorskip("transformers")
    from .common import build_model, tiny_config

    model = build_model()
    state = model.state_dict()
    theirs, ours = tmp_path / "theirs", tmp_path / "ours"
    model.save_pretrained(theirs, max_shard_size="100KB")
    their_index = json.loads((theirs / "model.safetensors.index.json").read_text())

    layouts, index = plan_checkpoint(specs_of(state), "100KB")
    assert index is not None and len(layouts) > 2
    assert index["weight_map"] == their_index["weight_map"]
    assert index["metadata"]["total_size"] == their_index["metadata"]["total_size"]
    assert sorted(p.name for p in theirs.glob("*.safetensors")) == [l.filename for l in layouts]

    # Their checkpoint through our reader.
    files = CheckpointFiles(theirs)
    assert set(files.names()) == set(state)
    for name, t in state.items():
        assert_same(files.read(name), t, name)

    # Our checkpoint (2 "ranks" per file) through transformers' loader.
    ours.mkdir()
    for layout in layouts:
        write_ranks(ours / layout.filename, layout, {n: state[n] for n in layout.specs},
                    lambda name, rank: chunk_ranges(state[name].shape[0], 2)[rank],
                    creator=1, open_order=[0, 1], sequential=False)
    write_json(ours / "model.safetensors.index.json", index)
    tiny_config().save_pretrained(ours)
    loaded = transformers.LlamaForCausalLM.from_pretrained(ours, dtype=torch.float32)
    for name, t in loaded.state_dict().items():
        assert_same(t, state[name], name)


@pytest.mark.parametrize("size,expected", [
    ("5GB", 5 * 10**9), ("500MiB", 500 * 2**20), ("500MB", 500 * 10**6), ("1.5GB", 1_500_000_000),
    ("10KB", 10_000), ("10KiB", 10_240), ("2TB", 2 * 10**12), ("1TiB", 2**40), ("3GiB", 3 * 2**30),
    ("5gb", 5 * 10**9), (" 7 MB ", 7_000_000), ("123", 123), ("64B", 64), (123, 123), (1, 1),
])
def test_parse_size(size, expected):
    assert parse_size(size) == expected


@pytest.mark.parametrize("size", ["5XB", "GB", "", "five GB", "-5GB", "5 G B", "1e9", "0", "0GB", "0.1B", 0, -3,
                                  "5GB5"])
def test_parse_size_refuses(size):
    with pytest.raises(ValueError, match="`max_shard_size`"):
        parse_size(size)


def test_parse_size_agrees_with_the_hub_for_decimal_units():
    hub = pytest.importorskip("huggingface_hub.serialization._base")
    for text in ["5GB", "10MB", "1KB", "2TB", "0.5GB", "123KB"]:
        assert parse_size(text) == hub.parse_size_to_int(text), text


# ---------------------------------------------------------------------------------------------
# 3. Fuzz: corrupted files are refused with a CheckpointError naming the file (and tensor), never worse


@contextlib.contextmanager
def deadline(seconds: float):
    """Fail instead of hanging."""
    def on_alarm(signum, frame):
        raise TimeoutError(f"took more than {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def fuzz_base() -> tuple[bytes, dict, bytes]:
    """A small valid file (from safetensors itself), split into (raw header, header dict, data)."""
    g = torch.Generator().manual_seed(4)
    tensors = {
        "embed.weight": torch.randn(3, 4, generator=g),
        "norm.bias": torch.randn(5, generator=g).to(torch.bfloat16),  # 10 bytes: odd offsets after it
        "step": torch.tensor(7, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 2),
    }
    blob = save(tensors)
    n = struct.unpack("<Q", blob[:8])[0]
    raw = blob[8:8 + n]
    return raw, json.loads(raw), blob[8 + n:]


def save(tensors: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save

    return save(tensors, metadata={"format": "pt"})


def assemble(header: dict | bytes, data: bytes, *, pad: bool = True, length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    if pad:
        raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def variants() -> list[tuple[str, bytes, str | None, str]]:
    """(label, file bytes, tensor the error must name or None, expectation: 'error' | 'valid' | 'either')."""
    raw, header, data = fuzz_base()
    base = assemble(raw, data, pad=False)
    n, size = len(raw), len(base)
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    out: list[tuple[str, bytes, str | None, str]] = [("base", base, None, "valid")]

    def edit(label, name, change, expect="error"):
        h = copy.deepcopy(header)
        d = change(h, h[name]) if name else change(h)
        out.append((label, assemble(h, d if isinstance(d, bytes) else data), name, expect))

    # Truncation at every boundary and at random points.
    cuts = {0, 1, 4, 7, 8, 9, 8 + n // 2, 8 + n - 1, 8 + n, 8 + n + 1, size - 1}
    for e in tensors.values():
        lo, hi = e["data_offsets"]
        cuts |= {8 + n + lo - 1, 8 + n + lo, 8 + n + lo + 1, 8 + n + hi - 1, 8 + n + hi}
    rng = random.Random(1234)
    cuts |= {rng.randrange(size) for _ in range(25)}
    for cut in sorted(c for c in cuts if 0 <= c < size):
        out.append((f"truncated at {cut}", base[:cut], None, "error"))

    # Length prefix.
    for length in [size - 8 + 1, size, 2**63, 2**64 - 1, 100 * 1024 * 1024 + 1, n + 1, n - 1, n - 8, 0, 1, 2]:
        out.append((f"header length {length}", assemble(raw, data, pad=False, length=length), None, "error"))
    # Header not JSON / not an object / not UTF-8.
    not_json = [b"not json", b"{", b'{"a":}', b"\xff\xfe{}", json.dumps(header).encode("utf-16"),
                b"\xef\xbb\xbf" + raw, raw + b"\0", raw.replace(b"{", b"{{", 1),
                raw.replace(b'"embed.weight"', b'"embed\x01weight"'), raw.replace(b'"embed.weight"', b'"\\ud800"'),
                raw.replace(b'"embed.weight"', b'"\xc3\x28"')]
    for i, text in enumerate(not_json):
        out.append((f"not json {i}", assemble(text, data), None, "error"))
    # Numbers Python's json reads but safetensors (serde_json) does not take as sizes.
    assert b'"shape":[3,4]' in raw and b'"shape":[0,2]' in raw and b'"data_offsets":[0,8]' in raw
    for old_text, new_text in [
        (b'"shape":[3,4]', b'"shape":[NaN,4]'), (b'"shape":[3,4]', b'"shape":[Infinity,4]'),
        (b'"shape":[3,4]', b'"shape":[1e400,4]'), (b'"shape":[3,4]', b'"shape":[3.0,4]'),
        (b'"shape":[3,4]', b'"shape":[3,4e0]'), (b'"shape":[0,2]', b'"shape":[-0,2]'),
        (b'"data_offsets":[0,8]', b'"data_offsets":[-0,8]'),
    ]:
        out.append((f"number {new_text!r}", assemble(raw.replace(old_text, new_text), data), None, "error"))
    for text in [b"[]", b'"str"', b"1", b"null", b"true"]:
        out.append((f"not an object {text!r}", assemble(text, data), None, "error"))
    # __metadata__.
    for bad in [[], {"x": 1}, "pt", {"x": None}, 1]:
        edit(f"metadata {bad!r}", None, lambda h, bad=bad: h.__setitem__("__metadata__", bad))
    edit("metadata null", None, lambda h: h.__setitem__("__metadata__", None), "valid")
    edit("no metadata", None, lambda h: h.pop("__metadata__"), "valid")
    out.append(("metadata twice", assemble(raw.replace(b"{", b'{"__metadata__":{},', 1), data), None, "error"))
    # Trailing bytes, data flips, whitespace in the padding.
    out.append(("1 trailing byte", base + b"\0", None, "error"))
    out.append(("8 trailing bytes", base + b"\0" * 8, None, "error"))
    for i in range(5):
        b = bytearray(base)
        b[8 + n + rng.randrange(len(data))] ^= 0xFF
        out.append((f"data flip {i}", bytes(b), None, "valid"))
    out.append(("tabs and newlines", assemble(raw.rstrip() + b"\n\t\r" + b" " * (-(len(raw.rstrip()) + 3) % 8),
                                              data, pad=False), None, "valid"))
    out.append(("unpadded", assemble(raw.rstrip(), data, pad=False), None, "valid"))
    out.append(("empty", assemble(b"{}", b""), None, "valid"))

    # One tensor's entry at a time.
    for name, e in tensors.items():
        lo, hi = e["data_offsets"]
        edit(f"{name}: unknown dtype", name, lambda h, e: e.__setitem__("dtype", "Q99"))
        edit(f"{name}: lower-case dtype", name, lambda h, e: e.__setitem__("dtype", e["dtype"].lower()))
        edit(f"{name}: dtype not a string", name, lambda h, e: e.__setitem__("dtype", 32))
        for key in ("dtype", "shape", "data_offsets"):
            edit(f"{name}: no {key}", name, lambda h, e, key=key: e.pop(key))
        edit(f"{name}: extra key", name, lambda h, e: e.__setitem__("extra", [1, 2.5]), "valid")
        edit(f"{name}: negative dim", name, lambda h, e: e.__setitem__("shape", [-1] + e["shape"]))
        edit(f"{name}: negative dims", name, lambda h, e: e.__setitem__("shape", [-d for d in e["shape"]] or [-1]))
        for bad_shape in ["3", None, [2.0], [True], [[1]], {"0": 1}, [2**64, 0], [2**40, 2**40, 0]]:
            edit(f"{name}: shape {bad_shape!r}", name, lambda h, e, s=bad_shape: e.__setitem__("shape", s))
        edit(f"{name}: one row more", name, lambda h, e: e.__setitem__("shape", [e["shape"][0] + 1] + e["shape"][1:]
                                                                         if e["shape"] else [2]))
        edit(f"{name}: one byte more", name, lambda h, e: e.__setitem__("data_offsets", [lo, hi + 1]))
        edit(f"{name}: shifted by 1", name, lambda h, e: e.__setitem__("data_offsets", [lo + 1, hi + 1]))
        edit(f"{name}: past the end", name, lambda h, e: e.__setitem__("data_offsets", [lo + size, hi + size]))
        edit(f"{name}: reversed", name, lambda h, e: e.__setitem__("data_offsets", [hi, lo]),
             "valid" if lo == hi else "error")
        for bad_offsets in [[lo], [lo, hi, hi], [-1, hi - lo - 1], [str(lo), str(hi)], [float(lo), float(hi)],
                            None, [lo + 2**64, hi + 2**64]]:
            edit(f"{name}: offsets {bad_offsets!r}", name,
                 lambda h, e, o=bad_offsets: e.__setitem__("data_offsets", o))
        for bad_entry in [None, [lo, hi], "F32", 3]:
            edit(f"{name}: entry {bad_entry!r}", name, lambda h, e, b=bad_entry, name=name: h.__setitem__(name, b))
        for other, oe in tensors.items():  # moved onto another tensor's bytes
            if other != name:
                olo = oe["data_offsets"][0]
                # An empty tensor may sit anywhere between tensors; an empty `other` may sit where `name` is.
                expect = "either" if lo == hi or olo == lo else "error"
                edit(f"{name}: onto {other}", name,
                     lambda h, e, olo=olo: e.__setitem__("data_offsets", [olo, olo + hi - lo]), expect)

        def gap(h, e, lo=lo):  # 8 unclaimed bytes just before this tensor
            for other, oe in h.items():
                if other != "__metadata__" and (oe["data_offsets"][0] > lo or oe is e):
                    oe["data_offsets"] = [x + 8 for x in oe["data_offsets"]]
            return data[:lo] + b"\0" * 8 + data[lo:]
        edit(f"{name}: gap before", name, gap)
        twice = raw.replace(b"{", b'{"%s":%s,' % (name.encode(), json.dumps(e).encode()), 1)
        out.append((f"{name}: key twice", assemble(twice, data), name, "error"))

    # Random byte flips inside the JSON header, and a few in the length prefix.
    for i in range(200):
        b = bytearray(base)
        for _ in range(rng.choice([1, 1, 1, 2, 3])):
            b[8 + rng.randrange(n)] = rng.randrange(256)
        out.append((f"header flip {i}", bytes(b), None, "either"))
    for i in range(20):
        b = bytearray(base)
        b[rng.randrange(8)] ^= 1 << rng.randrange(8)
        out.append((f"prefix flip {i}", bytes(b), None, "error"))
    return out


def safetensors_accepts(path: Path) -> bool:
    try:
        with safe_open(path, "pt") as f:
            for k in f.keys():
                f.get_tensor(k)
        return True
    except Exception:  # SafetensorError, or e.g. OverflowError from a huge shape
        return False


def test_fuzz_corrupt_files(tmp_path):
    cases = variants()
    assert len(cases) > 400
    outcomes = {"refused": 0, "accepted": 0}
    with deadline(15):
        for i, (label, blob, name, expect) in enumerate(cases):
            path = tmp_path / f"v{i:04d}.safetensors"
            path.write_bytes(blob)
            theirs = safetensors_accepts(path)
            try:
                layout = read_layout(path)
            except CheckpointError as e:
                outcomes["refused"] += 1
                message = str(e)
                assert str(path) in message, (label, message)
                if name is not None:
                    assert name in message, (label, message)
                assert expect != "valid", (label, message)
                if theirs:  # we may only be stricter where we say why: duplicate keys, dtypes we do not load
                    assert "appears twice" in message or "is not supported" in message, (label, message)
                continue
            except Exception as e:  # noqa: BLE001 - the point: nothing else may leak
                pytest.fail(f"{label}: read_layout leaked {type(e).__name__}: {e}")
            outcomes["accepted"] += 1
            assert expect != "error", label
            assert theirs, f"{label}: read_layout accepted a file that safetensors refuses"
            with safe_open(path, "pt") as f:
                assert set(f.keys()) == set(layout.specs), label
                for key in f.keys():
                    t = f.get_tensor(key)
                    spec = layout.specs[key]
                    assert (t.dtype, tuple(t.shape)) == (spec.dtype, spec.shape), label
                    assert_same(read_rows(path, layout, key, 0, rows_of(t)), t, f"{label}: {key}")
    assert outcomes["refused"] > 300 and outcomes["accepted"] > 10, outcomes


def canonical_variants() -> list[bytes]:
    """Compact headers that sit on the edge of the fast path's regular expression."""
    raw = fuzz_base()[0].rstrip()
    entry = b'"w":{"dtype":"F32","shape":[3,4],"data_offsets":[0,48]}'
    out = [raw, b"{}", b'{"__metadata__":{}}', b'{"__metadata__":null}', b'{"__metadata__":null,%s}' % entry,
           b'{"__metadata__":{},}', b'{%s,}' % entry, b'{,%s}' % entry, b'{%s%s}' % (entry, entry),
           b'{"__metadata__":{"a":"\\u00e9\\n"},%s}' % entry, b'{"__metadata__":{"a":"\\ud800"},%s}' % entry,
           b'{"__metadata__":{"a":"x","a":"y"},%s}' % entry, b'{"__metadata__":{"a":1},%s}' % entry,
           b'{%s,"__metadata__":{}}' % entry, b'{%s,%s}' % (entry, entry)]
    for old, new in [(b"[3,4]", b"[03,4]"), (b"[3,4]", b"[3,-0]"), (b"[3,4]", b"[]"), (b"[0,48]", b"[00,48]"),
                     (b"[3,4]", b"[18446744073709551616,4]"), (b"[3,4]", b"[18446744073709551615,0]"),
                     (b"[0,48]", b"[0,18446744073709551664]"), (b'"w"', b'"w\\u0041"'), (b'"w"', b'"w\x01"'),
                     (b'"w"', b'"\xc3\xa9"'), (b'"w"', b'"__metadata__"'), (b'"F32"', b'"f32"'),
                     (b'"F32"', b'"F8_E4M3"'), (b'"dtype":"F32","shape":[3,4]', b'"shape":[3,4],"dtype":"F32"'),
                     (b"48]}", b'48],"x":1}'), (b":[3,4]", b": [3,4]"), (b"[3,4]", b"[3,4,]")]:
        out.append(b"{%s}" % entry.replace(old, new))
    return out + [b"{%s}   \n" % entry, b"{%s}\x00" % entry]


def test_fast_and_exact_header_paths_agree():
    """The regular-expression path must give what json.loads with strict hooks gives, or defer to it."""
    from hf_fsdp2.checkpoint.header import _parse_canonical, parse_header

    headers = canonical_variants()
    for _, blob, _, _ in variants():
        if len(blob) >= 8 and 8 + struct.unpack("<Q", blob[:8])[0] <= len(blob):
            raw = blob[8:8 + struct.unpack("<Q", blob[:8])[0]]
            headers.append(raw)
            try:  # the edited headers were written with json.dumps' spaces: also try them compact
                headers.append(json.dumps(json.loads(raw), separators=(",", ":")).encode())
            except (ValueError, RecursionError):
                pass
    taken = 0
    for raw in headers:
        outcomes = []
        for fast in (True, False):
            try:
                outcomes.append(parse_header(raw, Path("h"), fast=fast))
            except CheckpointError as e:  # the position in a JSON error may differ (a substring was parsed)
                outcomes.append(str(e).split(" (")[0])
        assert outcomes[0] == outcomes[1], raw[:200]
        try:
            taken += _parse_canonical(raw) is not None
        except (UnicodeError, ValueError):
            pass
    assert taken > 100, taken  # many variants are canonical (compact, in the writers' key order)


def test_read_layout_missing_or_unreadable_file(tmp_path):
    with pytest.raises(CheckpointError, match="not found") as e:
        read_layout(tmp_path / "nope.safetensors")
    assert str(tmp_path / "nope.safetensors") in str(e.value)
    (tmp_path / "dir.safetensors").mkdir()
    with pytest.raises(CheckpointError) as e:
        read_layout(tmp_path / "dir.safetensors")
    assert str(tmp_path / "dir.safetensors") in str(e.value)


def test_read_layout_unsupported_dtype_is_named(tmp_path):
    raw, header, data = fuzz_base()
    header["embed.weight"]["dtype"] = "U32"  # valid safetensors, not a dtype we load
    path = tmp_path / "u.safetensors"
    path.write_bytes(assemble(header, data))
    assert safetensors_accepts(path)
    with pytest.raises(CheckpointError, match="'embed.weight': dtype 'U32' is not supported"):
        read_layout(path)


# ---------------------------------------------------------------------------------------------
# 4. Index files and CheckpointFiles


@pytest.mark.parametrize("filename", ["../model.safetensors", "/etc/passwd", "sub/model.safetensors", "..", ".", "",
                                      "model.safetensors/", "./model.safetensors", "a\\..\\b", "nul\0byte",
                                      None, 3, ["model.safetensors"], {"f": 1}])
def test_read_index_refuses_names_outside_the_directory(tmp_path, filename):
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {"ok": "model-00001-of-00002.safetensors",
                                                                 "bad": filename}}))
    with pytest.raises(CheckpointError, match="outside") as e:
        read_index(index)
    assert str(index) in str(e.value)


@pytest.mark.parametrize("content", ['{"metadata": {}}', '{"weight_map": ["a"]}', '{"weight_map": null}',
                                     '[]', '"weight_map"', "not json", "", '{"weight_map": {"a": "x"}'])
def test_read_index_needs_a_weight_map(tmp_path, content):
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(content)
    with pytest.raises(CheckpointError, match="weight_map") as e:
        read_index(index)
    assert str(index) in str(e.value)


def test_read_index_missing_or_unreadable(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        read_index(tmp_path / "model.safetensors.index.json")
    (tmp_path / "dir.index.json").mkdir()
    with pytest.raises(CheckpointError, match="dir.index.json"):
        read_index(tmp_path / "dir.index.json")
    (tmp_path / "bin.index.json").write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(CheckpointError, match="weight_map"):
        read_index(tmp_path / "bin.index.json")


def test_read_index_maps_to_files_in_the_directory(tmp_path):
    index = tmp_path / "model.safetensors.index.json"
    write_json(index, {"metadata": {"total_size": 8}, "weight_map": {"a": "m-1.safetensors", "b": "m-2.safetensors"}})
    assert read_index(index) == {"a": tmp_path / "m-1.safetensors", "b": tmp_path / "m-2.safetensors"}


def test_checkpoint_files_without_any_file(tmp_path):
    with pytest.raises(CheckpointError) as e:
        CheckpointFiles(tmp_path)
    assert str(tmp_path) in str(e.value) and "model.safetensors" in str(e.value)
    with pytest.raises(CheckpointError) as e:
        CheckpointFiles(tmp_path / "missing_dir", "adapter_model.safetensors")
    assert "missing_dir" in str(e.value) and "adapter_model.safetensors" in str(e.value)


def write_sharded(directory: Path, tensors: dict[str, torch.Tensor], max_shard_size) -> dict:
    layouts, index = plan_checkpoint(specs_of(tensors), max_shard_size)
    for layout in layouts:
        write_ranks(directory / layout.filename, layout, {n: tensors[n] for n in layout.specs},
                    lambda name, rank: chunk_ranges(rows_of(tensors[name]), 3)[rank] if tensors[name].dim()
                    else ((0, 1) if rank == 0 else (0, 0)),
                    creator=0, open_order=[2, 1, 0], sequential=True)
    if index is not None:
        write_json(directory / "model.safetensors.index.json", index)
    return index


def test_checkpoint_files_sharded_round_trip(tmp_path):
    tensors = mixed_tensors()
    index = write_sharded(tmp_path, tensors, 40)
    assert len(set(index["weight_map"].values())) > 3
    files = CheckpointFiles(tmp_path)
    assert set(files.names()) == set(tensors)
    for name, t in tensors.items():
        assert files.where[name].name == index["weight_map"][name]
        assert_same(files.read(name), t, name)


def test_checkpoint_files_index_lists_a_tensor_its_file_lacks(tmp_path):
    tensors = mixed_tensors()
    index = write_sharded(tmp_path, tensors, 40)
    first = index["weight_map"]["model.embed.weight"]
    index["weight_map"]["ghost.weight"] = first
    index["weight_map"]["half"] = first  # exists, but in another file
    write_json(tmp_path / "model.safetensors.index.json", index)
    with pytest.raises(CheckpointError) as e:
        CheckpointFiles(tmp_path)
    message = str(e.value)
    assert "model.safetensors.index.json" in message and "ghost.weight" in message and "half" in message


def test_checkpoint_files_index_names_a_missing_or_corrupt_file(tmp_path):
    tensors = mixed_tensors()
    index = write_sharded(tmp_path, tensors, 40)
    victim = tmp_path / index["weight_map"]["half"]
    victim.write_bytes(victim.read_bytes()[:-1])
    with pytest.raises(CheckpointError) as e:
        CheckpointFiles(tmp_path)
    assert str(victim) in str(e.value)
    victim.unlink()
    with pytest.raises(CheckpointError, match="not found") as e:
        CheckpointFiles(tmp_path)
    assert str(victim) in str(e.value)


def test_checkpoint_files_ignores_tensors_the_index_puts_elsewhere(tmp_path):
    a = tmp_path / "model-00001-of-00002.safetensors"
    b = tmp_path / "model-00002-of-00002.safetensors"
    save_file({"x": torch.zeros(2), "y": torch.ones(2)}, a)
    save_file({"x": torch.full((2,), 5.0)}, b)
    write_json(tmp_path / "model.safetensors.index.json",
               {"metadata": {"total_size": 16}, "weight_map": {"x": b.name, "y": a.name}})
    files = CheckpointFiles(tmp_path)
    assert files.where == {"x": b, "y": a}
    assert_same(files.read("x"), torch.full((2,), 5.0))


def test_checkpoint_files_index_wins_over_a_single_file(tmp_path):
    tensors = {"w": torch.randn(3, 2)}
    write_sharded(tmp_path, {"w": tensors["w"], "v": torch.randn(4)}, 16)
    save_file({"stale": torch.zeros(1)}, tmp_path / "model.safetensors")
    assert set(CheckpointFiles(tmp_path).names()) == {"w", "v"}
