"""Checkpoint save/load benchmark: hf_fsdp2 against the two ways people do it today.

One command, one run, side by side, on N gloo ranks on CPU that this script spawns itself:

SAVE
  ours          `hf_fsdp2.save_pretrained`: every rank pwrites its own rows into model.safetensors.
  gather_rank0  what Accelerate's `save_model` does for FSDP2: `full_tensor()` per parameter, rank 0
                keeps the full state dict, then `safetensors.torch.save_file`.
  dcp_hf        torch DCP: `dcp.save(model.state_dict(), storage_writer=HuggingFaceStorageWriter(
                path, save_distributed=True, enable_consolidation=True))` (per-rank shard files, then
                rank 0 consolidates them into one HF file).
LOAD (all three read the same model.safetensors, written by `save_pretrained`, into a sharded model)
  ours          `hf_fsdp2.load_pretrained`: every rank preads its own rows.
  rank0_bcast   Accelerate's `cpu_ram_efficient_loading` pattern: rank 0 `load_file`s the full state
                dict, then per tensor `dist.broadcast` + `distribute_tensor` (as
                `accelerate.utils.fsdp_utils.fsdp2_load_full_state_dict`) and every rank keeps its shard.
  dcp_hf        `dcp.load(model.state_dict(), storage_reader=HuggingFaceStorageReader(path))`.

Per operation: wall time between two barriers (median of --repeats timed rounds, after one
untimed warm-up round; methods are interleaved within each round), bytes written (sum of the
sizes of the files produced, and the kernel's per-process `write_bytes` summed over ranks), and the
peak extra RSS per rank (VmHWM after resetting it via /proc/self/clear_refs, cross-checked by a 5 ms
VmRSS sampler thread, minus VmRSS before the call; max over ranks and runs). Page cache: every save
starts from an empty output directory after `sync()` (no earlier run's writeback in flight); every
load reads a file already in the page cache (warm; `--drop-cache` evicts it with
fadvise(DONTNEED) before each load instead). Also, interleaved with the saves, the disk's raw
sequential write speed for the same number of bytes (rank 0 alone, 16 MiB `os.write` blocks,
then fsync): the physical limit for a durable save.

    python benchmarks/checkpoint_bench.py                                  # 1.5 GB model, 4 ranks
    python benchmarks/checkpoint_bench.py --model-gb 0.4 --world-size 2 --repeats 1
    python benchmarks/checkpoint_bench.py --model-gb 0.4 1.5 3 --world-size 2 4 --fsync --profile
    python benchmarks/checkpoint_bench.py --training-loop     # saves inside training: sync, async, DCP
                                                              # async_save (benchmarks/checkpoint_loop.py)

Results: a table on stdout, `benchmarks/results/checkpoint_<timestamp>.json` and `.png` beside it.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

import harness
from harness import RssSampler, hwm_bytes, malloc_trim, reset_hwm, rss_bytes

REPO, RESULTS_DIR = harness.REPO, harness.RESULTS_DIR
TMP_ROOT = harness.TMP_ROOT
MiB = 1 << 20
RSS_TARGET_BYTES = 64 * MiB  # the "64 MB", read as MiB
SPEEDUP_TARGET = 5.0
SAVE_METHODS = ("ours", "gather_rank0", "dcp_hf")
FSYNC_VARIANTS = ("ours_nofsync", "gather_rank0+fsync", "dcp_hf+fsync")
LOAD_METHODS = ("ours", "rank0_bcast", "dcp_hf")
PEERS_AS_SHIPPED = ("gather_rank0", "dcp_hf")
# Whether each save makes its files durable (fsync) before returning.
DURABLE = {
    "ours": "yes (fsync of every file + directory)",
    "ours_nofsync": "no (`save_pretrained(..., durable=False)`: same atomic commit, no fsync)",
    "gather_rank0": "no",
    "gather_rank0+fsync": "yes (fsync added by this benchmark)",
    "dcp_hf": "partial (DCP fsyncs the per-rank shard files, not the consolidated file)",
    "dcp_hf+fsync": "yes (consolidated files fsynced by this benchmark)",
}


# ---------------------------------------------------------------------------------------------
# Model shape


def llama_shape(model_gb: float, vocab: int = 32000) -> dict:
    """A Llama shape of about `model_gb` * 1e9 fp32 bytes: head_dim 128, MLP 8/3 * hidden, untied
    embeddings, the widest hidden size that still leaves at least 8 decoder layers."""
    target = model_gb * 1e9
    best = None
    for hidden in range(512, 16385, 128):
        inter = max(256, int(round(8 / 3 * hidden / 256)) * 256)
        emb = 2 * vocab * hidden * 4 + hidden * 4  # embed_tokens + lm_head + final norm
        layer = (4 * hidden * hidden + 3 * hidden * inter + 2 * hidden) * 4
        layers = int(round((target - emb) / layer))
        if layers < 8 and best is not None:
            break
        best = dict(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=max(1, layers),
                    num_attention_heads=hidden // 128, num_key_value_heads=hidden // 128, vocab_size=vocab)
        if layers < 8:
            break
    return best


def shape_bytes(shape: dict) -> int:
    h, i, n, v = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"], shape["vocab_size"]
    return (2 * v * h + h + n * (4 * h * h + 3 * h * i + 2 * h)) * 4


# ---------------------------------------------------------------------------------------------
# Memory and I/O probes (Linux /proc)


def io_write_bytes() -> int | None:
    """Bytes this process caused to be written to storage (counted at page-dirtying time)."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("write_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def dir_bytes(path: Path) -> tuple[int, list[tuple[str, int]]]:
    files = []
    for root, _, names in os.walk(path):
        for name in names:
            p = Path(root) / name
            files.append((str(p.relative_to(path)), p.stat().st_size))
    return sum(s for _, s in files), sorted(files)


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    for root, _, names in os.walk(path):
        for name in names:
            fsync_path(Path(root) / name)
        fsync_path(Path(root))


def evict_from_page_cache(path: Path) -> None:
    """posix_fadvise(DONTNEED) every file under `path` (no root needed; clean pages only)."""
    for root, _, names in os.walk(path):
        for name in names:
            fd = os.open(Path(root) / name, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


# ---------------------------------------------------------------------------------------------
# Rank side: model, the methods, measurement


def build_model(shape: dict, fill_seed: int | None):
    """A sharded LlamaForCausalLM built on the meta device (the full model never exists on a rank).

    With `fill_seed`, local shards get random values; else zeros (every page touched either way, so
    RSS measured afterwards does not include first-touch of the model's own memory).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_fsdp2

    config = LlamaConfig(**shape, max_position_embeddings=2048, tie_word_embeddings=False,
                         attention_dropout=0.0)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    hf_fsdp2.shard_model(model, hf_fsdp2.FSDP2Config(), init_weights=False)
    gen = torch.Generator().manual_seed(fill_seed) if fill_seed is not None else None
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local()
            if gen is not None:
                local.normal_(0.0, 0.02, generator=gen)
            else:
                local.zero_()
    return model


def local_bytes(model) -> int:
    return sum(p.to_local().numel() * p.element_size() for p in model.parameters())


def save_ours(model, out: Path, rank: int, *, fsync: bool = False) -> None:
    import hf_fsdp2

    hf_fsdp2.save_pretrained(model, out, progress=False)


def save_ours_nofsync(model, out: Path, rank: int, *, fsync: bool = False) -> None:
    import hf_fsdp2

    hf_fsdp2.save_pretrained(model, out, progress=False, durable=False)


def save_gather_rank0(model, out: Path, rank: int, *, fsync: bool = False) -> None:
    """Accelerate's `save_model` under FSDP2: the full state dict on rank 0, then save_file."""
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor

    full_sd = {}
    for name, tensor in model.state_dict().items():
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if rank == 0:
            full_sd[name] = full.detach().cpu()
        del full
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        save_file(full_sd, str(out / "model.safetensors"), metadata={"format": "pt"})
        if fsync:
            fsync_tree(out)
    del full_sd
    dist.barrier()


def save_dcp_hf(model, out: Path, rank: int, *, fsync: bool = False) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    writer = HuggingFaceStorageWriter(str(out), save_distributed=True, enable_consolidation=True)
    dcp.save(model.state_dict(), storage_writer=writer)
    if fsync:
        if rank == 0:  # the shard files are fsynced by DCP already; rank 0 wrote the rest
            for p in out.iterdir():
                if p.is_file():
                    fsync_path(p)
            fsync_path(out)
        dist.barrier()


_RAW_BLOCK: bytes | None = None


def save_raw_disk(model, out: Path, rank: int, *, fsync: bool = True) -> None:
    """The physical limit for a durable save: rank 0 alone writes as many bytes as the model has,
    `os.write` in 16 MiB blocks, then fsync; the other ranks wait at the closing barrier."""
    global _RAW_BLOCK
    if rank != 0:
        return
    _RAW_BLOCK = _RAW_BLOCK or os.urandom(16 * MiB)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    fd = os.open(out / "raw.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, memoryview(_RAW_BLOCK)[:min(left, len(_RAW_BLOCK))])
        t1 = time.perf_counter()
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    RAW_PHASES.update(write_s=t1 - t0, fsync_s=time.perf_counter() - t1)


RAW_PHASES: dict[str, float] = {}
RAW = "raw_disk"

SAVES = {
    RAW: (save_raw_disk, True),
    "ours": (save_ours, False),
    "ours_nofsync": (save_ours_nofsync, False),
    "gather_rank0": (save_gather_rank0, False),
    "gather_rank0+fsync": (save_gather_rank0, True),
    "dcp_hf": (save_dcp_hf, False),
    "dcp_hf+fsync": (save_dcp_hf, True),
}


def load_ours(target, src: Path, rank: int) -> None:
    import hf_fsdp2

    hf_fsdp2.load_pretrained(target, src, progress=False)


def load_rank0_bcast(target, src: Path, rank: int) -> None:
    """accelerate.utils.fsdp_utils.fsdp2_load_full_state_dict, fed by rank 0's `load_file`."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.distributed.tensor import distribute_tensor

    full_sd = load_file(str(src / "model.safetensors")) if rank == 0 else None
    with torch.no_grad():
        for name, sharded in target.state_dict().items():
            full = full_sd[name] if rank == 0 else torch.empty(sharded.shape, dtype=sharded.dtype)
            dist.broadcast(full, src=0)
            dtensor = distribute_tensor(full, sharded.device_mesh, sharded.placements)
            sharded.to_local().copy_(dtensor.to_local())
            del full, dtensor
    del full_sd


def load_dcp_hf(target, src: Path, rank: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    dcp.load(target.state_dict(), storage_reader=HuggingFaceStorageReader(str(src)))


LOADS = {"ours": load_ours, "rank0_bcast": load_rank0_bcast, "dcp_hf": load_dcp_hf}


def measure(fn, sample_interval: float) -> dict:
    """Run `fn` between two barriers; time, peak extra RSS, bytes dirtied."""
    import torch.distributed as dist

    gc.collect()
    malloc_trim()
    dist.barrier()
    base = rss_bytes()
    hwm_ok = reset_hwm()
    io0 = io_write_bytes()
    with RssSampler(sample_interval) as sampler:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        t1 = time.perf_counter()
    io1 = io_write_bytes()
    peak = max(sampler.max, hwm_bytes() if hwm_ok else 0)
    return {"time_s": t1 - t0, "rss_before": base, "rss_peak": peak, "extra_rss": max(0, peak - base),
            "sampler_peak": sampler.max, "sampler_samples": sampler.samples, "hwm_used": hwm_ok,
            "io_write_bytes": None if io0 is None else io1 - io0}


def checkpoint_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.suffix == ".safetensors")


def verify_file(model, directory: Path) -> bool:
    """Every rank compares its own rows of every tensor in `directory`'s top-level safetensors."""
    import torch
    from safetensors import safe_open
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    expected = {name: t for name, t in model.state_dict().items()}
    seen = set()
    for path in checkpoint_files(directory):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                t = expected[name]
                shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
                rows = f.get_slice(name)[offset[0]:offset[0] + shape[0]]
                if not torch.equal(rows, t.to_local()):
                    return False
                seen.add(name)
    return seen == set(expected)


def verify_loaded(target, source) -> bool:
    import torch

    src = dict(source.named_parameters())
    return all(torch.equal(p.to_local(), src[n].to_local()) for n, p in target.named_parameters())


class PhaseTimer:
    """Benchmark-only instrumentation: wraps hf_fsdp2 internals and sums wall time per phase."""

    def __init__(self):
        self.t: dict[str, float] = {}
        self.n: dict[str, int] = {}
        self._undo = []

    def wrap(self, owner, attrs: str | tuple[str, ...], phase: str) -> None:
        """Wrap the first of `attrs` that `owner` has (internal names change; profile what is there)."""
        attrs = (attrs,) if isinstance(attrs, str) else attrs
        attr = next((a for a in attrs if hasattr(owner, a)), None)
        if attr is None:
            self.t.setdefault(f"(not found: {'/'.join(attrs)})", 0.0)
            return
        orig = getattr(owner, attr)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                self.t[phase] = self.t.get(phase, 0.0) + time.perf_counter() - t0
                self.n[phase] = self.n.get(phase, 0) + 1

        setattr(owner, attr, timed)
        self._undo.append((owner, attr, orig))

    # (module, attribute or candidate names) -> phase label; indentation shows nesting. save_pretrained
    # calls export_items/write_tensors/write_configs through pretrained's names (imported from export_plan and weights_io).
    PHASES = {
        ("pretrained", ("export_items", "_export_items")): "export_items",
        ("atomic_dir", "recover"): "recover (rank 0)",
        ("atomic_dir", "agree"): "agree (all-reduce, waits for slowest rank)",
        ("pretrained", "write_tensors"): "write_tensors (all files)",
        ("weights_io", "plan_checkpoint"): "  plan_headers",
        ("FileWriter", "__init__"): "  open+header+ftruncate",
        ("FileWriter", "write_rows"): "  write_rows",
        ("safetensors_io", "_pwrite_all"): "    pwrite syscalls",
        ("FileWriter", "close"): "  close (fsync data file)",
        ("pretrained", ("write_configs", "_write_configs")): "config.json (rank 0)",
        ("atomic_dir", "_swap_in"): "swap_in: fsync dirs + renames (rank 0)",
    }

    def __enter__(self):
        from hf_fsdp2.checkpoint import atomic_dir, pretrained, safetensors_io, weights_io

        owners = {"pretrained": pretrained, "weights_io": weights_io, "atomic_dir": atomic_dir,
                  "safetensors_io": safetensors_io,
                  "FileWriter": safetensors_io.FileWriter}
        for (owner, attr), phase in self.PHASES.items():
            self.wrap(owners[owner], attr, phase)
        self.wrap(os, "fsync", "os.fsync (any)")
        return self

    def __exit__(self, *exc):
        for owner, attr, orig in reversed(self._undo):
            setattr(owner, attr, orig)


def run_job(rank: int, world: int, job: dict) -> dict:
    import torch.distributed as dist

    tmp = Path(job["tmp"])
    repeats, interval = job["repeats"], job["sample_interval"]
    out = {"rank": rank, "save": {}, "load": {}, "profile": None}
    rss_start = rss_bytes()
    model = build_model(job["shape"], fill_seed=1000 + rank)
    out["shard_bytes"] = local_bytes(model)
    out["rss_model"] = rss_bytes() - rss_start

    # Rounds: round 0 is the untimed warm-up of every method, then `repeats` timed rounds. Methods are
    # interleaved within a round so that slow drifts of the machine (this VM's disk and fresh-page
    # costs vary several-fold over minutes) hit every method alike.
    save_methods = job["save_methods"]
    for rnd in range(1 + repeats):
        for method in save_methods:
            fn, fsync = SAVES[method]
            path = tmp / f"save_{method.replace('+', '_')}"
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
                os.sync()  # no earlier run's writeback in flight
            RAW_PHASES.clear()
            m = measure(lambda: fn(model, path, rank, fsync=fsync), interval)
            m.update(RAW_PHASES)
            if rank == 0:
                m["bytes_written"], m["files"] = dir_bytes(path)
            if rnd == 0:
                out["save"].setdefault("verified", {})[method] = method == RAW or verify_file(model, path)
            else:
                out["save"].setdefault(method, []).append(m)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)

    if job["profile"] and "ours" in job["save_methods"]:
        path = tmp / "save_profile"
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
            os.sync()
        with PhaseTimer() as timer:
            m = measure(lambda: save_ours(model, path, rank), interval)
        out["profile"] = {"time_s": m["time_s"], "phases": timer.t, "calls": timer.n}
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)

    if job["load_methods"]:
        import torch

        import hf_fsdp2

        src = tmp / "load_src"
        if rank == 0:
            shutil.rmtree(src, ignore_errors=True)
        hf_fsdp2.save_pretrained(model, src, progress=False)
        target = build_model(job["shape"], fill_seed=None)  # one target, zeroed before every run
        for rnd in range(1 + repeats):
            for method in job["load_methods"]:
                with torch.no_grad():
                    for p in target.parameters():
                        p.to_local().zero_()
                if job["drop_cache"]:
                    if rank == 0:
                        evict_from_page_cache(src)
                    dist.barrier()
                m = measure(lambda: LOADS[method](target, src, rank), interval)
                m["verified"] = verify_loaded(target, model)
                if rnd > 0:
                    out["load"].setdefault(method, []).append(m)
        del target
        dist.barrier()
        if rank == 0:
            shutil.rmtree(src, ignore_errors=True)
    return out


def run_ranks(world: int, job: dict, timeout: float) -> list[dict]:
    return harness.run_ranks(run_job, world, job, timeout)


# ---------------------------------------------------------------------------------------------
# Aggregation, report


def summarize(ranks: list[dict], kind: str, method: str) -> dict:
    per_rank = [r[kind][method] for r in ranks]
    repeats = len(per_rank[0])
    times = [max(per_rank[k][i]["time_s"] for k in range(len(ranks))) for i in range(repeats)]
    extra = [max(r[i]["extra_rss"] for i in range(repeats)) for r in per_rank]  # per rank, max over runs
    s = {"time_s": statistics.median(times), "times_s": times,
         "extra_rss_max": max(extra), "extra_rss_per_rank": extra,
         "sampler_peak_extra_per_rank": [max(max(0, x["sampler_peak"] - x["rss_before"]) for x in r)
                                         for r in per_rank]}
    io = [x["io_write_bytes"] for r in per_rank for x in r]
    if all(v is not None for v in io):
        s["io_write_bytes"] = statistics.median(
            sum(per_rank[k][i]["io_write_bytes"] for k in range(len(ranks))) for i in range(repeats))
    if method == RAW:
        s["write_only_s"] = statistics.median(x["write_s"] for x in per_rank[0])
        s["fsync_s"] = statistics.median(x["fsync_s"] for x in per_rank[0])
        s["bytes"] = per_rank[0][0]["bytes_written"]
        s["GBps_with_fsync"] = s["bytes"] / s["time_s"] / 1e9
        s["GBps_write_only"] = s["bytes"] / s["write_only_s"] / 1e9
        return s
    if kind == "save":
        s["bytes_written"] = per_rank[0][0]["bytes_written"]
        s["files"] = per_rank[0][0]["files"]
        s["verified"] = all(r["save"]["verified"][method] for r in ranks)
        s["durable"] = DURABLE[method]
    else:
        shard = [r["shard_bytes"] for r in ranks]
        s["peak_rss_per_rank"] = [shard[k] + extra[k] for k in range(len(ranks))]
        s["peak_rss_max"] = max(s["peak_rss_per_rank"])
        s["verified"] = all(x["verified"] for r in per_rank for x in r)
    return s


def mib(n: float) -> str:
    return f"{n / MiB:,.0f}"


def report_config(res: dict) -> list[str]:
    """Print one configuration's tables, ratios and PASS/FAIL lines; return the PASS/FAIL lines."""
    model_bytes, world, shape = res["model_bytes"], res["world_size"], res["shape"]
    disk = res["raw_disk"]
    print(f"\n=== Llama fp32 {model_bytes / 1e9:.3f} GB (hidden {shape['hidden_size']}, "
          f"{shape['num_hidden_layers']} layers, vocab {shape['vocab_size']}), {world} gloo ranks, "
          f"median of {res['repeats']} timed run(s) after 1 warm-up ===")
    if disk:
        print(f"raw disk sequential write of {model_bytes / 1e9:.2f} GB (rank 0 alone, 16 MiB os.write blocks, "
              f"interleaved with the saves): {disk['write_only_s']:.2f} s to page cache "
              f"({disk['GBps_write_only']:.2f} GB/s) + {disk['fsync_s']:.2f} s fsync = {disk['time_s']:.2f} s "
              f"({disk['GBps_with_fsync']:.2f} GB/s); runs {' '.join(f'{t:.2f}' for t in disk['times_s'])}")
    save, load = res["save"], res["load"]
    if save:
        print(f"\n{'SAVE':<20}{'time s':>8}{'extra RSS MiB':>15}{'(per rank)':>26}"
              f"{'written GB':>12}{'x model':>9}{'dirtied GB':>12}  ok  runs s / durable")
        for m, s in save.items():
            runs = " ".join(f"{t:.2f}" for t in s["times_s"])
            per = "/".join(mib(x) for x in s["extra_rss_per_rank"])
            dirtied = f"{s['io_write_bytes'] / 1e9:.2f}" if s.get("io_write_bytes") is not None else "n/a"
            print(f"{m:<20}{s['time_s']:>8.2f}{mib(s['extra_rss_max']):>15}{per:>26}"
                  f"{s['bytes_written'] / 1e9:>12.3f}{s['bytes_written'] / model_bytes:>9.3f}{dirtied:>12}"
                  f"  {'ok' if s['verified'] else 'BAD'}  [{runs}] {s['durable']}")
        if disk:
            runs = " ".join(f"{t:.2f}" for t in disk["times_s"])
            print(f"{'raw disk + fsync':<20}{disk['time_s']:>8.2f}{'':>15}{'':>26}"
                  f"{disk['bytes'] / 1e9:>12.3f}{disk['bytes'] / model_bytes:>9.3f}{'':>12}      "
                  f"[{runs}] physical limit for a durable write")
    if load:
        print(f"\n{'LOAD':<20}{'time s':>8}{'extra RSS MiB':>15}{'(per rank)':>26}"
              f"{'peak RSS MiB':>14}{'limit MiB':>11}  ok  runs s")
        limit = model_bytes / world + RSS_TARGET_BYTES
        for m, s in load.items():
            runs = " ".join(f"{t:.2f}" for t in s["times_s"])
            per = "/".join(mib(x) for x in s["extra_rss_per_rank"])
            print(f"{m:<20}{s['time_s']:>8.2f}{mib(s['extra_rss_max']):>15}{per:>26}"
                  f"{mib(s['peak_rss_max']):>14}{mib(limit):>11}  {'ok' if s['verified'] else 'BAD'}  [{runs}]")
        print("  peak RSS = the rank's own shard bytes + peak extra RSS during the call; limit = model/N + 64 MiB")

    lines = []

    def verdict(ok: bool, text: str) -> None:
        line = f"{'PASS' if ok else 'FAIL'}  [{model_bytes / 1e9:.2f} GB x {world}] {text}"
        lines.append(line)

    if "ours" in save:
        ours = save["ours"]
        peers = {m: save[m] for m in PEERS_AS_SHIPPED if m in save}
        print("\nratios (save):")
        if peers:
            best = min(peers, key=lambda m: peers[m]["time_s"])
            speedup = peers[best]["time_s"] / ours["time_s"]
            print(f"  ours {ours['time_s']:.2f} s vs best peer {best} {peers[best]['time_s']:.2f} s: "
                  f"{speedup:.2f}x faster (target >= {SPEEDUP_TARGET:.0f}x)")
            need = peers[best]["time_s"] / SPEEDUP_TARGET
            if disk:
                print(f"  ours takes {ours['time_s'] / disk['time_s']:.2f}x the raw disk+fsync time "
                      f"({disk['time_s']:.2f} s); {SPEEDUP_TARGET:.0f}x faster than {best} needs {need:.2f} s, "
                      f"{need / disk['time_s']:.2f}x the raw disk+fsync time")
            verdict(speedup >= SPEEDUP_TARGET, f"save >= {SPEEDUP_TARGET:.0f}x faster than best peer "
                    f"({best}): {speedup:.2f}x ({ours['time_s']:.2f} s vs {peers[best]['time_s']:.2f} s)")
            durable_peers = {m: save[m] for m in ("gather_rank0+fsync", "dcp_hf+fsync") if m in save}
            if durable_peers:
                bd = min(durable_peers, key=lambda m: durable_peers[m]["time_s"])
                print(f"  like for like, durable: ours {ours['time_s']:.2f} s vs {bd} "
                      f"{durable_peers[bd]['time_s']:.2f} s: {durable_peers[bd]['time_s'] / ours['time_s']:.2f}x")
            if "ours_nofsync" in save:
                nf = save["ours_nofsync"]["time_s"]
                print(f"  like for like, no fsync: ours_nofsync {nf:.2f} s vs {best} {peers[best]['time_s']:.2f} s: "
                      f"{peers[best]['time_s'] / nf:.2f}x")
            for m, s in peers.items():
                print(f"  extra RSS ours {mib(ours['extra_rss_max'])} MiB vs {m} {mib(s['extra_rss_max'])} MiB; "
                      f"bytes written ours {ours['bytes_written'] / model_bytes:.3f}x vs {m} "
                      f"{s['bytes_written'] / model_bytes:.3f}x the model")
        verdict(ours["extra_rss_max"] <= RSS_TARGET_BYTES,
                f"save extra RSS per rank <= 64 MiB: max {ours['extra_rss_max'] / MiB:.1f} MiB")
        ratio = ours["bytes_written"] / model_bytes
        verdict(ratio <= 1.01, f"save bytes written = 1.0x the model (<= 1.01x allowed for header+config): "
                f"{ratio:.4f}x ({ours['bytes_written']:,} B for {model_bytes:,} B of tensors)")
    if "ours" in load:
        ours = load["ours"]
        peers = {m: load[m] for m in load if m != "ours"}
        print("\nratios (load):")
        for m, s in peers.items():
            print(f"  ours {ours['time_s']:.2f} s vs {m} {s['time_s']:.2f} s: {s['time_s'] / ours['time_s']:.2f}x; "
                  f"peak RSS ours {mib(ours['peak_rss_max'])} MiB vs {mib(s['peak_rss_max'])} MiB")
        limit = model_bytes / world + RSS_TARGET_BYTES
        verdict(ours["peak_rss_max"] <= limit, f"load peak RSS per rank <= model/N + 64 MiB: "
                f"{ours['peak_rss_max'] / MiB:.0f} MiB <= {limit / MiB:.0f} MiB")
    verdict(all(s["verified"] for s in [*save.values(), *load.values()]),
            "every file written and every load verified bit-exact against the source shards")
    if res.get("profile"):
        print_profile(res["profile"])
    return lines


def print_profile(profile: list[dict]) -> None:
    print("\nprofile of one ours save (instrumented, seconds per rank; phases nest as indented):")
    order = list(PhaseTimer.PHASES.values()) + ["os.fsync (any)"]
    seen = {k for p in profile for k in p["phases"]}
    phases = [k for k in order if k in seen] + sorted(seen - set(order))
    print(f"  {'phase':<46}" + "".join(f"{'rank ' + str(r):>10}" for r in range(len(profile))))
    print(f"  {'total (barrier to barrier)':<46}" + "".join(f"{p['time_s']:>10.3f}" for p in profile))
    for ph in phases:
        print(f"  {ph:<46}" + "".join(f"{p['phases'].get(ph, 0.0):>10.3f}" for p in profile))


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['model_bytes'] / 1e9:.2f} GB\n{r['world_size']} ranks" for r in results]
    panels = [("save time (s)", "save", "time_s", 1),
              ("save extra RSS per rank, max (MiB)", "save", "extra_rss_max", MiB),
              ("bytes written / model bytes", "save", "written_ratio", 1),
              ("load time (s)", "load", "time_s", 1),
              ("load peak RSS per rank, max (MiB)", "load", "peak_rss_max", MiB),
              ("load extra RSS per rank, max (MiB)", "load", "extra_rss_max", MiB)]
    fig, axes = plt.subplots(2, 3, figsize=(max(15, 4 * len(results) + 9), 9))
    for ax, (title, kind, key, scale) in zip(axes.flat, panels):
        methods = list(dict.fromkeys(m for r in results for m in r[kind]))
        if kind == "save" and key == "time_s":
            methods.append("raw disk + fsync")
        width = 0.8 / max(1, len(methods))
        for j, m in enumerate(methods):
            vals = []
            for r in results:
                if m == "raw disk + fsync":
                    vals.append(r["raw_disk"]["time_s"] if r["raw_disk"] else 0)
                elif m not in r[kind]:
                    vals.append(0)
                elif key == "written_ratio":
                    vals.append(r[kind][m]["bytes_written"] / r["model_bytes"])
                else:
                    vals.append(r[kind][m][key] / scale)
            xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(results))]
            ax.bar(xs, vals, width, label=m, hatch="//" if m == "raw disk + fsync" else None)
        if key == "peak_rss_max":
            for i, r in enumerate(results):
                lim = (r["model_bytes"] / r["world_size"] + RSS_TARGET_BYTES) / MiB
                ax.hlines(lim, i - 0.45, i + 0.45, colors="k", linestyles="--")
        if key == "extra_rss_max" and kind == "save":
            ax.axhline(RSS_TARGET_BYTES / MiB, color="k", linestyle="--", linewidth=1)
        ax.set_xticks(range(len(results)))
        ax.set_xticklabels(labels)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7)
    fig.suptitle("hf_fsdp2 checkpoint benchmark (CPU, gloo; dashed = target)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--training-loop" in argv:  # saves inside a training loop (async vs sync vs DCP async_save)
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import checkpoint_loop

        return checkpoint_loop.main([a for a in argv if a != "--training-loop"])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-gb", type=float, nargs="+", default=[1.5], help="model sizes in GB (1e9 B), fp32")
    ap.add_argument("--world-size", type=int, nargs="+", default=[4], help="gloo ranks (one run per value)")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per method (median), after 1 warm-up")
    ap.add_argument("--fsync", action="store_true",
                    help="also run like-for-like variants: peers that fsync their files, ours without fsync")
    ap.add_argument("--profile", action="store_true", help="one extra instrumented ours save: time per phase")
    ap.add_argument("--drop-cache", action="store_true",
                    help="evict the checkpoint from the page cache (fadvise DONTNEED) before every load")
    ap.add_argument("--save-methods", nargs="*", choices=SAVE_METHODS, default=list(SAVE_METHODS))
    ap.add_argument("--load-methods", nargs="*", choices=LOAD_METHODS, default=list(LOAD_METHODS))
    ap.add_argument("--no-raw-disk", action="store_true", help="skip the raw sequential write measurement")
    ap.add_argument("--sample-ms", type=float, default=5.0, help="VmRSS sampling interval")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for the ranks, per config")
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    save_methods = list(args.save_methods) + (list(FSYNC_VARIANTS) if args.fsync else [])
    save_methods = [m for m in save_methods if m.split("+")[0].replace("_nofsync", "") in args.save_methods]
    if not args.no_raw_disk:
        save_methods.insert(0, RAW)

    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    tmp = TMP_ROOT / f"run-{stamp}-{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    import torch

    meta = {"timestamp": stamp, "argv": sys.argv[1:], "git": harness.git_state(), "python": platform.python_version(),
            "torch": torch.__version__, "cpus": os.cpu_count(), "platform": platform.platform(),
            "mem_total_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
            "page_cache": ("warm: one untimed warm-up round, then timed rounds with the methods interleaved; saves "
                           "start from an empty output directory after sync(); loads read a file already in the "
                           "page cache"
                           + ("; --drop-cache: fadvise(DONTNEED) on the file before every load" if args.drop_cache
                              else "")),
            "rss": "peak VmHWM (reset via /proc/self/clear_refs) and a 5 ms VmRSS sampler, minus VmRSS before the "
                   "call; max over ranks and timed runs",
            "disk": "tmp dir " + str(tmp)}
    results, verdicts = [], []
    try:
        for gb in args.model_gb:
            shape = llama_shape(gb)
            model_bytes = shape_bytes(shape)
            for world in args.world_size:
                job = {"shape": shape, "tmp": str(tmp), "repeats": args.repeats, "save_methods": save_methods,
                       "load_methods": list(args.load_methods), "profile": args.profile,
                       "drop_cache": args.drop_cache, "sample_interval": args.sample_ms / 1000}
                t0 = time.perf_counter()
                ranks = run_ranks(world, job, args.timeout)
                res = {"model_gb": gb, "model_bytes": model_bytes, "shape": shape, "world_size": world,
                       "repeats": args.repeats, "wall_s": time.perf_counter() - t0,
                       "raw_disk": summarize(ranks, "save", RAW) if RAW in save_methods else None,
                       "shard_bytes_per_rank": [r["shard_bytes"] for r in ranks],
                       "save": {m: summarize(ranks, "save", m) for m in save_methods if m != RAW},
                       "load": {m: summarize(ranks, "load", m) for m in args.load_methods},
                       "profile": [r["profile"] for r in ranks] if args.profile and ranks[0]["profile"] else None,
                       "raw_ranks": ranks}
                results.append(res)
                verdicts += report_config(res)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    print("\nTargets:")
    for line in verdicts:
        print("  " + line)
    json_path = args.out_dir / f"checkpoint_{stamp}.json"
    png_path = json_path.with_suffix(".png")
    json_path.write_text(json.dumps({"meta": meta, "results": results, "verdicts": verdicts}, indent=1))
    plot(results, png_path)
    print(f"\nwrote {json_path.relative_to(REPO) if json_path.is_relative_to(REPO) else json_path}")
    print(f"wrote {png_path.relative_to(REPO) if png_path.is_relative_to(REPO) else png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
