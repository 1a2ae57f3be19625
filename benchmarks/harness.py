"""What the benchmarks share: memory probes (Linux /proc) and rank processes.

Imported by train_bench.py, checkpoint_bench.py (and checkpoint_loop.py through it) and
qlora_memory.py, which run as scripts from this folder (so `import harness` finds it, in the
spawned ranks too).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import multiprocessing as mp
import os
import queue
import socket
import subprocess
import time
import traceback
from pathlib import Path
from typing import Any, Callable

# The memory probes live in the package (hf-fsdp2 simulate reads them too).
from hf_fsdp2.runtime.memory_probe import (  # noqa: F401 - re-exported for the benchmarks
    RssSampler, hwm_bytes, malloc_bytes, reset_hwm, rss_bytes, status_bytes)

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "benchmarks" / "results"
TMP_ROOT = RESULTS_DIR / "tmp"  # gitignored, on the same disk as the repo


def git_state() -> dict:
    """The commit results were measured on, and whether hf_fsdp2/ had uncommitted changes."""
    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"commit": git("rev-parse", "HEAD"), "hf_fsdp2_dirty": bool(git("status", "--porcelain", "hf_fsdp2"))}


def write_results(prefix: str, argv: list[str] | None, **fields: Any) -> Path:
    """`results/<prefix>-<UTC stamp>.json` with what every result records (time, arguments, commit,
    Python, machine, CPUs) and `fields`; returns its path."""
    import json
    import platform
    import sys

    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{prefix}-{stamp}.json"
    path.write_text(json.dumps({"timestamp": stamp, "argv": sys.argv[1:] if argv is None else list(argv),
                                "git": git_state(), "python": platform.python_version(),
                                "machine": platform.machine(), "cpus": os.cpu_count(), **fields}, indent=1))
    return path

def write_fsync(path: Path, nbytes: int) -> float:
    """Seconds to write `nbytes` of random data to `path` in 16 MiB `os.write` blocks, then fsync: the disk's
    own time for a durable write of that many bytes (what a save is compared with)."""
    chunk = os.urandom(16 << 20)
    t = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, memoryview(chunk)[:min(left, len(chunk))])
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t


# ---------------------------------------------------------------------------------------------
# Memory probes


def malloc_trim() -> None:
    """Give freed heap memory back to the OS so the next baseline RSS is not inflated."""
    from hf_fsdp2.runtime import host_allocator

    host_allocator.trim()


@contextlib.contextmanager
def backend_collectives(result: dict):
    """`result["backend_collectives"]`: {op: calls} of the process-group ops (torch.profiler's "gloo:..." /
    "nccl:..." events) run inside the block, wherever they were issued from (a compiled graph included)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        yield
    result["backend_collectives"] = {e.key: e.count for e in prof.key_averages()
                                     if e.key.split(":")[0] in ("gloo", "nccl")}


# ---------------------------------------------------------------------------------------------
# Rank processes


# What a tiny mode's ranks import (run_ranks' `preload`): torch, transformers' models, Accelerate, PEFT, hf_fsdp2.
TINY_PRELOAD = ("torch", "torch.distributed.fsdp", "transformers", "transformers.modeling_utils", "accelerate", "peft",
                "hf_fsdp2")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_entry(run: Callable[[int, int, dict], Any], rank: int, world: int, port: int, job: dict, results,
                threads: int, backend: str | None, pg_timeout: _dt.timedelta) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        if backend is not None:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                              WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
            if backend == "nccl":
                torch.cuda.set_device(rank % torch.cuda.device_count())
            dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world, timeout=pg_timeout)
        results.put((rank, "ok", run(rank, world, job)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(run: Callable[[int, int, dict], Any], world: int, job: dict, timeout: float, *, threads: int = 1,
              backend: str | None = "gloo", pg_timeout: _dt.timedelta = _dt.timedelta(minutes=30),
              preload: tuple[str, ...] = ()) -> list:
    """`run(rank, world, job)` in `world` fresh (spawned) processes with `threads` torch threads and a
    process group of `backend` (None: none); their results by rank. `run` must be a module-level
    function. Any rank's exception, or `timeout` seconds without a result, raises with the tracebacks.

    `preload`: modules imported once by a fork server the ranks are forked from, instead of by every spawned
    rank (each rank's start ~5 s of CPU in imports: a tiny mode's whole cost). For tiny modes only: the server's
    environment and allocator state are the ranks' (set before its first use), and its pages count in their RSS."""
    ctx = mp.get_context("forkserver" if preload else "spawn")
    if preload:
        ctx.set_forkserver_preload(list(preload))  # no effect once the server runs: the first call's list holds
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_entry, args=(run, r, world, port, job, results, threads, backend, pg_timeout),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    out, errors = {}, []
    try:
        for _ in range(world):
            rank, status, value = results.get(timeout=timeout)
            if status == "ok":
                out[rank] = value
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
                timeout = 15
    except queue.Empty:
        errors.append(f"timed out after {timeout:.0f}s; finished ranks {sorted(out)}")
    finally:
        for p in procs:
            p.join(timeout=10 if not errors else 1)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("benchmark ranks failed:\n" + "\n".join(errors))
    return [out[r] for r in range(world)]
