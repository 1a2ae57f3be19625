"""Run a function on N real processes (gloo on 127.0.0.1) and collect what each rank returns."""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import pickle
import queue
import random
import runpy
import socket
import subprocess
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

# A default process group with NCCL's device semantics on a CPU-only machine: its only backend is for
# CUDA tensors, so a CPU tensor sent through it fails exactly as NCCL refuses one ("No backend type
# associated with device type cpu"). hf_fsdp2 must never send one (runtime/collectives.py).
NCCL_LIKE = "cuda:gloo"


# Ranks are forked from a server process that imported these once (multiprocessing's "forkserver"):
# every rank is still a fresh process with no state from the tests, but it skips the ~5 s of imports a
# spawned interpreter pays (a 2-rank call: 5.3 s -> 0.1 s here; a Trainer's or TRL's script ~7 s a rank).
# Missing optional packages are skipped.
PRELOAD = ["torch", "torch.distributed.fsdp", "torch.distributed.tensor", "transformers",
           "transformers.models.llama.modeling_llama", "transformers.trainer", "accelerate", "peft", "hf_fsdp2",
           "tests.common"]
PRELOAD += [name for name in ("bitsandbytes", "trl") if importlib.util.find_spec(name) is not None]
_CONTEXT = mp.get_context("forkserver")
_CONTEXT.set_forkserver_preload(PRELOAD)


# The running test's markers (tests/conftest.py sets them; None outside pytest): launching without
# the `launch` mark, or forking ranks without `ranks`, fails by name.
CURRENT_MARKS: set[str] | None = None


def _require_mark(mark: str, what: str) -> None:
    if CURRENT_MARKS is not None and mark not in CURRENT_MARKS:
        raise AssertionError(f"this test {what} but is not marked `{mark}`: tests/conftest.py marks a test by the "
                             "functions it reaches; name the entry point there.")


_PORT_BAND = 1500  # ports per pytest-xdist worker, from 20000 up: below Linux's ephemeral range (32768+)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now. Under pytest-xdist (`-n 2`) each worker draws from a band of
    its own below the ephemeral range, so neither the other worker nor an outgoing connection can be
    handed the same port between this check and the launcher's use of it."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    low = 20000 + int(worker[2:]) * _PORT_BAND
    for port in random.sample(range(low, low + _PORT_BAND - 16), 200):  # + a few: restarts use port + attempt
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {low}-{low + _PORT_BAND} for pytest-xdist worker {worker}")


# ---------------------------------------------------------------------------------------------
# Launchers: every test that starts `accelerate launch` or torchrun builds its command here.


def accelerate_launch(config, *launch_args: str, processes: int | None = None, port: int | None = None) -> list[str]:
    """`accelerate launch --config_file config` with this interpreter, on a free port; append the script."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch"]
    if config is not None:
        cmd += ["--config_file", str(config)]
    if processes is not None:
        cmd += ["--num_processes", str(processes)]
    return cmd + ["--main_process_port", str(port if port is not None else free_port()), *launch_args]


def torchrun(processes: int, *launch_args: str) -> list[str]:
    """`torchrun` (python -m torch.distributed.run: no launcher on PATH needed), on a free port."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
            "--master_port", str(free_port()), *launch_args]


def launcher_environment(env: dict | None = None) -> dict[str, str]:
    """The environment a launcher runs in here: this process's, one thread per process, then `env`."""
    return {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}


def run_launched(cmd: list[str], *, cwd, env: dict | None = None, timeout: float = 400,
                 check: bool = True) -> subprocess.CompletedProcess:
    """Run a launcher command (in `launcher_environment(env)`); with `check`, fail with its output's tail."""
    _require_mark("launch", "starts a launcher")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env=launcher_environment(env))
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def _entry(fn, rank, world_size, port, results, args, kwargs, pg_timeout, backend, environ, cwd):
    import torch
    import torch.distributed as dist

    os.environ.clear()  # the caller's environment and directory now (the fork server's are from its start)
    os.environ.update(environ)
    os.chdir(cwd)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
        if backend is not None:  # None: `fn` starts it, as a launched script does
            dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=pg_timeout))
        out = fn(rank, world_size, *args, **kwargs)
        # Plain pickle, in memory: a queue would share tensors by file descriptor, which dies with us.
        results.put((rank, "ok", pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 240, pg_timeout: float = 120,
              backend: str | None = "gloo", **kwargs: Any) -> list[Any]:
    """Spawn `world_size` processes running `fn(rank, world_size, *args, **kwargs)`; return results by rank.

    `fn` must be a module-level function. Any rank's exception fails the call with its traceback.
    `backend`: the default group's; `NCCL_LIKE` gives GPU semantics on CPU (tests/test_gpu_semantics.py);
    None: no group is started for `fn` (a launched script starts its own).
    """
    out, errors = run_ranks_collecting_errors(fn, world_size, *args, timeout=timeout, pg_timeout=pg_timeout,
                                              backend=backend, **kwargs)
    if errors:
        raise AssertionError("distributed run failed:\n" + "\n".join(errors.values()))
    return [out[r] for r in range(world_size)]


def run_ranks_collecting_errors(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 240,
                                pg_timeout: float = 120, backend: str | None = "gloo",
                                **kwargs: Any) -> tuple[dict[int, Any], dict[int, str]]:
    """Like `run_ranks`, for runs where ranks are expected to fail: ({rank: result}, {rank: error}).

    `pg_timeout`: the process group's timeout, the bound on how long a collective waits for a peer.
    """
    _require_mark("ranks", "forks gloo ranks")
    results = _CONTEXT.Queue()
    port = free_port()
    environ = dict(os.environ)
    procs = [_CONTEXT.Process(target=_entry, daemon=True,
                              args=(fn, r, world_size, port, results, args, kwargs, pg_timeout, backend, environ,
                                    os.getcwd()))
             for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) + len(errors) < world_size and time.monotonic() < deadline:
            try:
                rank, status, value = results.get(timeout=0.5)
            except queue.Empty:
                # A process that died without reporting (killed, os._exit) counts as a failed rank.
                for r, p in enumerate(procs):
                    if p.exitcode not in (None, 0) and r not in errors and r not in out and results.empty():
                        errors[r] = f"--- rank {r} exited with code {p.exitcode} ---"
                        deadline = min(deadline, time.monotonic() + 30)
                continue
            if status == "ok":
                out[rank] = pickle.loads(value)
            else:
                errors[rank] = f"--- rank {rank} ---\n{value}"
                deadline = min(deadline, time.monotonic() + 30)  # the first error may only be a symptom
        for r in range(world_size):
            if r not in out and r not in errors:
                errors[r] = f"--- rank {r} timed out ---"
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
    return out, errors


# ---------------------------------------------------------------------------------------------
# A launched script on forked ranks: the launcher's workers without the launcher's interpreters.


def _launched_worker(rank: int, world_size: int, script: str, argv: list[str], worker_env: dict[str, str],
                     cwd: str) -> None:
    """`python script *argv` as a torchrun worker of rank `rank`: the environment the launcher computed, plus the
    per-rank variables torchrun's agent adds (torch/distributed/elastic/agent/server/local_elastic_agent.py,
    `_start_workers`; one node, so local = global), then what an interpreter does at exit (non-daemon threads
    joined, the exit handlers the script registered run: an async save commits there)."""
    import atexit

    import torch

    port = os.environ["MASTER_PORT"]  # the harness's free port
    os.environ.clear()
    os.environ.update(worker_env)
    os.chdir(cwd)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_NAME="default",
                      LOCAL_WORLD_SIZE=str(world_size), WORLD_SIZE=str(world_size), GROUP_WORLD_SIZE="1",
                      ROLE_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                      TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID="none",
                      TORCHELASTIC_USE_AGENT_STORE="False",  # no agent: rank 0 hosts the store
                      TORCH_NCCL_ASYNC_ERROR_HANDLING=worker_env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"))
    torch.set_num_threads(int(worker_env.get("OMP_NUM_THREADS", "1")))
    atexit._clear()  # inherited from the fork server, not registered by this script (running them here hangs)
    sys.argv = [script, *argv]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as ended:
        if ended.code not in (None, 0):
            raise
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()


def run_script_ranks(script, argv: list[str], world_size: int, *, worker_env: dict[str, str], cwd,
                     timeout: float = 300) -> None:
    """Run `script argv` on `world_size` ranks forked from the fork server, each with `worker_env` (what a
    launcher hands its workers: tests/launched_runs.py computes it with Accelerate's own launch functions) and
    torchrun's per-rank variables. What a real launch adds is its own interpreters (~10 CPU-s for two workers on
    2 cores) and the launcher's process management, which the tests that launch for real keep covering. What a
    library reads from the environment at import was read once, in the fork server (the suite's own environment):
    give a forked run only variables read at run time (HF_FSDP2_*, Accelerate's, torch.distributed's), and launch
    for real where an import-time one matters (an offline hub cache, a start-up switch). Any rank's exception
    fails the call with its traceback."""
    run_ranks(_launched_worker, world_size, str(script), list(argv), dict(worker_env), str(cwd), timeout=timeout,
              pg_timeout=timeout, backend=None)
