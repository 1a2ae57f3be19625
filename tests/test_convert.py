"""`hf-fsdp2 convert`: Accelerate SHARDED_STATE_DICT (DCP) checkpoints written by real gloo ranks -> safetensors."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open

from hf_fsdp2.checkpoint import convert as convert_mod
from hf_fsdp2.cli import main
from hf_fsdp2.checkpoint.convert import convert_dcp_to_safetensors, read_dcp_metadata
from hf_fsdp2.checkpoint.safetensors_io import WRITE_CHUNK_BYTES, CheckpointError

from .common import build_model
from .dist_harness import run_ranks

REPO = Path(__file__).resolve().parents[1]
# dcp.save/dcp.load with no process group say so on every call; that is what these tests mean to do.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _save_like_accelerate(rank, world, output_dir):
    """Shard the tiny model and save it with Accelerate's own `save_fsdp_model` (SHARDED_STATE_DICT, FSDP2).

    `save_fsdp_model` reads only the plugin for this path (the accelerator argument is used by the
    FULL/LOCAL branches), but its logger needs an initialised `PartialState`.
    """
    from accelerate import PartialState
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import save_fsdp_model

    from hf_fsdp2 import shard_model

    PartialState()
    model = build_model()
    shard_model(model)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    save_fsdp_model(plugin, None, model, output_dir)
    if rank == 0:  # what a training script saves next to the weights
        model.config.save_pretrained(output_dir)
        model.generation_config.save_pretrained(output_dir)
    return True


@pytest.fixture(scope="module")
def accelerate_ckpt(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("accelerate") / "checkpoint"
    run_ranks(_save_like_accelerate, 2, str(out))
    return out


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return build_model().state_dict()


def _from_pretrained(directory: Path, **kwargs) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, **kwargs).state_dict()


def _assert_equal(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys(), set(actual) ^ set(expected)
    for k, v in expected.items():
        assert actual[k].dtype == v.dtype, k
        assert torch.equal(actual[k], v), k


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


# ---------------------------------------------------------------------------------------------


def test_layout_is_accelerates(accelerate_ckpt):
    """What the fixture wrote is Accelerate's layout: one DCP dir, one file per rank, keys under "model"."""
    dcp_dir = accelerate_ckpt / "pytorch_model_fsdp_0"
    assert sorted(p.name for p in dcp_dir.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    md = read_dcp_metadata(dcp_dir)
    q = md.state_dict_metadata["model.model.layers.0.self_attn.q_proj.weight"]
    assert len(q.chunks) == 2  # really sharded across the two ranks
    assert md.planner_data["model.lm_head.weight"] == ("model", "lm_head.weight")


def test_cli_converts_sharded_checkpoint(accelerate_ckpt, reference, tmp_path):
    dst = tmp_path / "hf"
    proc = subprocess.run([sys.executable, "-m", "hf_fsdp2.cli", "convert",
                           str(accelerate_ckpt / "pytorch_model_fsdp_0"), str(dst)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in dst.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    with safe_open(dst / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
    assert _leftovers(tmp_path) == []
    _assert_equal(_from_pretrained(dst), reference)


def test_sharded_output_and_index(accelerate_ckpt, reference, tmp_path):
    dst = tmp_path / "hf"
    limit = 100_000
    # The checkpoint directory itself is accepted: its only `pytorch_model_fsdp_*` child is used.
    assert main(["convert", str(accelerate_ckpt), str(dst), "--max-shard-size", "100KB"]) == 0
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in dst.glob("*.safetensors"))
    n = len(files)
    assert n > 2 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert set(index["weight_map"]) == set(reference)
    assert set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in reference.values())
    for name in files:
        with safe_open(dst / name, "pt") as f:
            keys = set(f.keys())
            assert f.metadata() == {"format": "pt"}
            assert sum(f.get_tensor(k).nbytes for k in keys) <= limit
        assert keys == {k for k, v in index["weight_map"].items() if v == name}
    _assert_equal(_from_pretrained(dst), reference)


def test_dtype_bf16(accelerate_ckpt, reference, tmp_path):
    dst = tmp_path / "hf"
    assert main(["convert", str(accelerate_ckpt), str(dst), "--dtype", "bf16"]) == 0
    with safe_open(dst / "model.safetensors", "pt") as f:
        for k in f.keys():
            t = f.get_tensor(k)
            assert t.dtype == torch.bfloat16 and torch.equal(t, reference[k].to(torch.bfloat16)), k
    assert json.loads((dst / "config.json").read_text())["dtype"] == "bfloat16"
    _assert_equal(_from_pretrained(dst, dtype=torch.bfloat16), {k: v.bfloat16() for k, v in reference.items()})


def test_config_dir_option(accelerate_ckpt, tmp_path):
    bare = tmp_path / "bare"  # a DCP dir with no config next to it
    bare.mkdir()
    for p in (accelerate_ckpt / "pytorch_model_fsdp_0").iterdir():
        (bare / p.name).symlink_to(p)
    result = convert_dcp_to_safetensors(bare, tmp_path / "no_config")
    assert result.config_source is None and not (tmp_path / "no_config" / "config.json").exists()
    result = convert_dcp_to_safetensors(bare, tmp_path / "with_config", config_dir=accelerate_ckpt)
    assert result.config_source == accelerate_ckpt
    assert (tmp_path / "with_config" / "config.json").read_bytes() == (accelerate_ckpt / "config.json").read_bytes()
    with pytest.raises(ValueError, match="has no config.json"):
        convert_dcp_to_safetensors(bare, tmp_path / "x", config_dir=tmp_path)


# ---------------------------------------------------------------------------------------------
# Errors


def test_missing_src(tmp_path, capsys):
    missing = tmp_path / "nope"
    assert main(["convert", str(missing), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert str(missing) in err and "no such file or directory" in err
    assert not (tmp_path / "out").exists()


def test_src_not_dcp(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.safetensors").write_bytes(b"x")
    assert main(["convert", str(src), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert str(src) in err and "not a torch.distributed.checkpoint directory" in err


def test_existing_dst_untouched_without_overwrite(accelerate_ckpt, reference, tmp_path, capsys):
    dst = tmp_path / "hf"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    assert main(["convert", str(accelerate_ckpt), str(dst)]) == 1
    err = capsys.readouterr().err
    assert str(dst) in err and "--overwrite" in err
    assert [p.name for p in dst.iterdir()] == ["keep.txt"] and (dst / "keep.txt").read_text() == "mine"
    assert _leftovers(tmp_path) == []
    # With --overwrite the directory is replaced whole.
    assert main(["convert", str(accelerate_ckpt), str(dst), "--overwrite"]) == 0
    assert not (dst / "keep.txt").exists()
    assert _leftovers(tmp_path) == []
    _assert_equal(_from_pretrained(dst), reference)


def test_failure_leaves_no_dst(accelerate_ckpt, tmp_path, monkeypatch):
    calls = []
    real = convert_mod._load_tensor

    def failing(*args):
        calls.append(1)
        if len(calls) == 3:
            raise OSError("disk on fire")
        return real(*args)

    monkeypatch.setattr(convert_mod, "_load_tensor", failing)
    with pytest.raises(OSError, match="disk on fire"):
        convert_dcp_to_safetensors(accelerate_ckpt, tmp_path / "hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_non_tensor_entries(tmp_path):
    src = tmp_path / "dcp"
    dcp.save({"model": {"w": torch.ones(2, 3), "step": 7}}, storage_writer=dcp.FileSystemWriter(src), no_dist=True)
    with pytest.raises(ValueError, match=r"not tensors \(model\.step\)") as info:
        convert_dcp_to_safetensors(src, tmp_path / "out")
    assert str(src) in str(info.value)
    assert not (tmp_path / "out").exists()


def test_optimizer_dir_is_refused(tmp_path):
    src = tmp_path / "optimizer_0"
    dcp.save({"optimizer": {"state": {"w": {"exp_avg": torch.ones(2)}}}},
             storage_writer=dcp.FileSystemWriter(src), no_dist=True)
    with pytest.raises(ValueError, match="optimizer checkpoint"):
        convert_dcp_to_safetensors(src, tmp_path / "out")


class _Exploit:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_metadata_pickle_is_restricted(tmp_path):
    """torch reads `.metadata` with a bare pickle.load; ours refuses globals outside DCP's metadata classes."""
    src = tmp_path / "evil"
    src.mkdir()
    (src / ".metadata").write_bytes(pickle.dumps(_Exploit()))
    with pytest.raises(ValueError, match=r"not a readable .*`(posix|nt)\.system` is not part of DCP's metadata"):
        convert_dcp_to_safetensors(src, tmp_path / "out")
    assert not (Path.cwd() / "pwned").exists() and not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# Memory

_MEASURE = textwrap.dedent("""
    import json, sys
    from hf_fsdp2.checkpoint.convert import convert_dcp_to_safetensors

    def rss(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024

    small, big, out = sys.argv[1:4]
    convert_dcp_to_safetensors(small, out + "/warm", dtype="bf16")  # warm up every code path
    growth = {}
    for dtype in ("fp32", "bf16"):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
        base = rss("VmRSS")
        convert_dcp_to_safetensors(big, f"{out}/{dtype}", dtype=dtype)
        growth[dtype] = rss("VmHWM") - base
    print(json.dumps(growth))
""")


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux /proc peak-RSS reset")
def test_peak_memory_is_about_one_tensor(tmp_path):
    """16 tensors of 8 MiB (128 MiB): peak RSS growth stays about two tensors (20-24 MiB), where loading the
    whole checkpoint (as `accelerate merge-weights` does) needs at least the 128 MiB.

    The converter holds one buffer the size of the largest tensor, plus one saved chunk while DCP reads
    it (here a whole tensor, saved by one process; 1/N of it in an N-rank checkpoint): measured 16 MiB.
    With the bf16 cast the writer also keeps its staging chunk (the cast rows, at most
    `WRITE_CHUNK_BYTES`, reused for every chunk: safetensors_io.FileWriter._host_chunk): 4 MiB here,
    measured 20 MiB. The bound is those parts plus 4 MiB of slack. glibc's malloc is
    told to return freed blocks (a fixed mmap threshold) so RSS measures the converter, not allocator
    retention; with glibc's defaults we measured 24-36 MiB, not growing with the number of tensors.
    """
    tensor_bytes, count = 8 * 2**20, 16
    small, big = tmp_path / "small", tmp_path / "big"
    dcp.save({"model": {"w": torch.ones(256, 1024)}}, storage_writer=dcp.FileSystemWriter(small), no_dist=True)
    dcp.save({"model": {f"layers.{i}.weight": torch.full((tensor_bytes // 4096, 1024), float(i))
                        for i in range(count)}}, storage_writer=dcp.FileSystemWriter(big), no_dist=True)
    proc = subprocess.run([sys.executable, "-c", _MEASURE, str(small), str(big), str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)})
    assert proc.returncode == 0, proc.stderr
    growth = json.loads(proc.stdout.strip().splitlines()[-1])
    print({k: f"{v / 2**20:.1f} MiB" for k, v in growth.items()})
    staging = {"fp32": 0, "bf16": min(tensor_bytes // 2, WRITE_CHUNK_BYTES)}  # no cast: no staging chunk
    for dtype, value in growth.items():
        bound = 2 * tensor_bytes + staging[dtype] + 4 * 2**20
        assert value < bound, f"{dtype}: peak RSS grew by {value / 2**20:.1f} MiB (bound {bound / 2**20:.0f} MiB)"
    with safe_open(tmp_path / "bf16" / "model.safetensors", "pt") as f:
        assert len(f.keys()) == count and torch.equal(f.get_tensor("layers.3.weight"), torch.full((2048, 1024), 3.0,
                                                                                               dtype=torch.bfloat16))


def test_odd_tensors_and_bare_state_dict(tmp_path):
    """A bare (unwrapped) model state dict with a scalar, an empty tensor and integers; bf16 casts floats only."""
    src = tmp_path / "dcp"
    tensors = {"scale": torch.tensor(2.5), "empty": torch.zeros(0, 4), "ids": torch.arange(6).reshape(2, 3),
               "w": torch.randn(5, 3, dtype=torch.float16)}
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(src), no_dist=True)
    convert_dcp_to_safetensors(src, tmp_path / "out", dtype="bf16")
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        assert set(f.keys()) == set(tensors)
        for k, v in tensors.items():
            expected = v.bfloat16() if v.is_floating_point() else v
            got = f.get_tensor(k)
            assert got.dtype == expected.dtype and got.shape == expected.shape and torch.equal(got, expected), k


# ---------------------------------------------------------------------------------------------
# Damaged checkpoints: refused before anything is allocated or written, in one line naming the file

Q = "model.model.layers.0.self_attn.q_proj.weight"  # (64, 64): rows 0-31 in __0_0.distcp, 32-63 in __1_0
K = "model.model.layers.0.self_attn.k_proj.weight"  # (32, 64): rows 0-15 in __0_0.distcp, 16-31 in __1_0


def _edit_metadata(edit):
    """A damage that rewrites `.metadata` (a pickled DCP `Metadata`) after `edit(metadata)` changed it."""
    def damage(dcp_dir: Path) -> None:
        with open(dcp_dir / ".metadata", "rb") as f:
            md = pickle.load(f)  # the fixture's own file
        edit(md)
        with open(dcp_dir / ".metadata", "wb") as f:
            pickle.dump(md, f)
    return damage


def _index(key, offsets):
    from torch.distributed.checkpoint.metadata import MetadataIndex

    return MetadataIndex(key, offsets)


def _storage(md, key, i):
    return md.storage_data[_index(key, md.state_dict_metadata[key].chunks[i].offsets)]


def _move_chunk(md, key, i, offsets, sizes=None):
    """Give chunk `i` new offsets (and sizes), keeping its storage entry (keyed by the offsets)."""
    chunk = md.state_dict_metadata[key].chunks[i]
    info = md.storage_data.pop(_index(key, chunk.offsets))
    chunk.offsets = torch.Size(offsets)
    chunk.sizes = torch.Size(sizes) if sizes is not None else chunk.sizes
    md.storage_data[_index(key, chunk.offsets)] = info


def _claim_768_gib(md):
    """q_proj claims (3 * 2**18, 2**18) fp32 = 768 GiB, in two chunks that tile it: only the files disagree."""
    rows, cols = 3 * 2**17, 2**18
    md.state_dict_metadata[Q].size = torch.Size([2 * rows, cols])
    _move_chunk(md, Q, 0, [0, 0], [rows, cols])
    _move_chunk(md, Q, 1, [rows, 0], [rows, cols])


def _swap_records(md):
    """gate_proj's rank-1 chunk is (64, 64) and down_proj's (32, 128): records of the same size, swapped."""
    gate, down = (_storage(md, f"model.model.layers.0.mlp.{m}.weight", 1) for m in ("gate_proj", "down_proj"))
    gate.offset, down.offset = down.offset, gate.offset


def _share_record(md):
    """k_proj's rank-0 chunk points at q_proj's larger record: each size check alone passes."""
    k, q = _storage(md, K, 0), _storage(md, Q, 0)
    k.offset, k.length = q.offset, q.length


def _file_damage(name, how):
    def damage(dcp_dir: Path) -> None:
        path = dcp_dir / name
        if how == "truncate":
            with open(path, "r+b") as f:
                f.truncate(path.stat().st_size // 2)
        elif how == "garbage":  # same size, not a torch.save record any more
            path.write_bytes(b"\0" * path.stat().st_size)
        else:
            path.unlink()
            if how == "fifo":
                os.mkfifo(path)
            elif how == "dir":
                path.mkdir()
    return damage


_META, _DATA1 = ".metadata", "__1_0.distcp"
# id -> (damage, file the error names, what it says)
DAMAGES = {
    "metadata-not-metadata": (lambda d: (d / _META).write_bytes(pickle.dumps({"state_dict_metadata": {}})), _META,
                              "holds a dict"),
    "metadata-missing-field": (_edit_metadata(lambda md: delattr(md, "state_dict_metadata")), _META,
                               "`state_dict_metadata` is missing"),
    "storage-data-not-dict": (_edit_metadata(lambda md: setattr(md, "storage_data", [1])), _META,
                              "`storage_data` is a list"),
    "planner-data-wrong": (_edit_metadata(lambda md: md.planner_data.update({Q: 5})), _META, "planner_data"),
    "metadata-truncated": (lambda d: (d / _META).write_bytes((d / _META).read_bytes()[:200]), _META,
                           "not a readable"),
    "metadata-fifo": (_file_damage(_META, "fifo"), _META, "not a regular file"),
    "metadata-dir": (_file_damage(_META, "dir"), _META, "not a regular file"),
    "dtype-not-dtype": (_edit_metadata(lambda md: setattr(md.state_dict_metadata[Q].properties, "dtype", "f32")),
                        _META, "has no dtype"),
    "negative-size": (_edit_metadata(lambda md: setattr(md.state_dict_metadata[Q], "size", torch.Size([-64, 64]))),
                      _META, "not a tuple of non-negative integers"),
    "no-chunks": (_edit_metadata(lambda md: setattr(md.state_dict_metadata[Q], "chunks", [])), _META,
                  "lists no saved chunks"),
    "chunk-not-chunk": (_edit_metadata(lambda md: md.state_dict_metadata[Q].chunks.append(5)), _META,
                        "has a chunk with offsets None"),
    "chunk-outside": (_edit_metadata(lambda md: _move_chunk(md, Q, 1, [48, 0])), _META, "lies outside the tensor"),
    "chunks-overlap": (_edit_metadata(lambda md: _move_chunk(md, Q, 1, [16, 0])), _META,
                       r"chunks at offsets \[0, 0\] and \[16, 0\] overlap"),
    "chunk-removed": (_edit_metadata(lambda md: md.state_dict_metadata[Q].chunks.pop()), _META,
                      "hold 2048 of 4096 elements"),
    "chunk-shrunk": (_edit_metadata(lambda md: _move_chunk(md, Q, 1, [32, 0], [16, 64])), _META,
                     "hold 3072 of 4096 elements"),
    "no-storage-entry": (_edit_metadata(lambda md: md.storage_data.pop(_index(Q, torch.Size([32, 0])))), _META,
                         r"offsets \[32, 0\] has no storage entry"),
    "storage-entry-wrong": (_edit_metadata(lambda md: setattr(_storage(md, Q, 1), "length", -1)), _META,
                            "the storage entry of"),
    "path-outside": (_edit_metadata(lambda md: setattr(_storage(md, Q, 1), "relative_path", "../x.distcp")), _META,
                     "points outside"),
    "compressed": (_edit_metadata(lambda md: setattr(_storage(md, Q, 1), "transform_descriptors", ["zstd"])),
                   _META, "DCP extensions"),
    "claims-768-GiB": (_edit_metadata(_claim_768_gib), "__0_0.distcp", "needs 412316860416 bytes"),
    "records-share-bytes": (_edit_metadata(_share_record), "__0_0.distcp", "records of .* overlap"),
    "records-swapped": (_edit_metadata(_swap_records), _DATA1, r"not a saved tensor of shape \[.*holds Tensor"),
    "data-missing": (_file_damage(_DATA1, "delete"), _DATA1, "data file is missing"),
    "data-truncated": (_file_damage(_DATA1, "truncate"), _DATA1, "truncated"),
    "data-fifo": (_file_damage(_DATA1, "fifo"), _DATA1, "not a regular file"),
    "data-dir": (_file_damage(_DATA1, "dir"), _DATA1, "not a regular file"),
    "data-garbage": (_file_damage(_DATA1, "garbage"), _DATA1, r"are not a saved tensor of shape \[64, 64\]: Unpickl"),
}


@pytest.fixture
def damaged_copy(accelerate_ckpt, tmp_path) -> Path:
    src = tmp_path / "ckpt" / "pytorch_model_fsdp_0"
    shutil.copytree(accelerate_ckpt / "pytorch_model_fsdp_0", src)
    return src


@pytest.mark.parametrize("damage", DAMAGES)
def test_damaged_checkpoint_is_refused(damaged_copy, tmp_path, capsys, damage):
    make, named, says = DAMAGES[damage]
    make(damaged_copy)
    dst = tmp_path / "out" / "hf"
    with pytest.raises(CheckpointError, match=says) as info:
        convert_dcp_to_safetensors(damaged_copy, dst)
    assert str(damaged_copy / named) in str(info.value)
    # The CLI: exit 1, one line naming the file, nothing created.
    assert main(["convert", str(damaged_copy), str(dst)]) == 1
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("hf-fsdp2 convert: error: "), captured.err
    assert str(damaged_copy / named) in lines[0] and "Traceback" not in captured.err + captured.out
    # Damage found while reading a record surfaces after dst's parent was made: it is left empty.
    assert not dst.exists() and (not dst.parent.exists() or not any(dst.parent.iterdir()))


def test_damaged_checkpoint_cli_process(damaged_copy, tmp_path):
    """The installed entry point too: a FIFO `.metadata` is refused at once, one line, no traceback."""
    _file_damage(_META, "fifo")(damaged_copy)
    dst = tmp_path / "hf"
    proc = subprocess.run([sys.executable, "-m", "hf_fsdp2.cli", "convert", str(damaged_copy), str(dst)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [f"hf-fsdp2 convert: error: {damaged_copy / _META}: not a regular file "
                                        "(a directory, FIFO or device); refused."]
    assert not dst.exists()


@pytest.mark.parametrize("chunks, error", [
    ([((0, 0), (2, 2)), ((0, 2), (2, 2)), ((2, 0), (2, 2)), ((2, 2), (2, 2))], None),  # a 2x2 grid (FSDP x TP)
    ([((0, 0), (2, 3)), ((0, 2), (2, 1)), ((2, 0), (2, 4))], r"\[0, 0\] and \[0, 2\] overlap"),  # sum is 16 too
    ([((0, 0), (4, 2)), ((4, 2), (0, 2)), ((4, 2), (0, 2)), ((0, 2), (4, 2))], None),  # empty shards at the end
    ([((0, 0), (4, 2)), ((1, 2), (3, 2))], "hold 14 of 16"),
])
def test_chunk_tiling_in_two_dims(chunks, error):
    """The sweep over dim 0 still compares chunks in the other dims: the second layout has an overlap and a
    hole of the same size, which element counts alone would accept."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata

    md = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([4, 4]),
                               [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks])
    if error is None:
        convert_mod._check_chunks(Path(".metadata"), "w", md)
    else:
        with pytest.raises(CheckpointError, match=error):
            convert_mod._check_chunks(Path(".metadata"), "w", md)
