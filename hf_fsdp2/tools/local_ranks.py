"""Several ranks of a real job in this one process, each a thread, on one device (issue 61).

`run_local_ranks(fn, 4)` calls `fn(rank, world_size, ...)` on four threads, each rank `rank` of 4 under
torch's threaded process group (torch/testing/_internal/distributed/multi_threaded_pg.py, the one torch's own
FSDP2 unit tests run on through `FSDPTestMultiThread`): every collective moves real data between the threads,
so each rank trains, saves and loads as it would in a process of its own, all on one GPU (or the CPU). It is
how the code paths of ranks other than 0 run on CUDA where the machine has one GPU: NCCL refuses two ranks on
one device, and gloo carries no CUDA reduce-scatter.

What differs from processes, and how it is handled:
- The process group is per thread: torch's threaded world keeps each thread's default group, and with c10d's
  thread isolation on, each thread resolves group names to its own groups. hf_fsdp2's side groups follow
  (runtime/collectives.py: threaded like the default group, kept per default group).
- One device for all ranks (`device`), set for the run (runtime/distributed.py `threads_shard_on`).
- The random generator is the process's: ranks drawing from it at once draw in no set order. Build what
  must be the same on every rank (the model's initial weights) one rank at a time (`one_at_a_time()`).
- The threaded group does a collective's copies on the thread of rank 0, on that thread's current CUDA stream,
  which no other rank's stream waits for: on CUDA each kernel must be done when it is launched,
  CUDA_LAUNCH_BLOCKING=1 set before CUDA starts (refused by name otherwise). It serialises the GPU: a check of
  what ranks compute, not of their speed.
- Not for: background saves (`async_save`: one saving thread per process), a launch (Accelerate's state and
  the Trainer read the process's environment), CP (its mesh is Accelerate's).

benchmarks/local_ranks_check.py runs issue 61's checks through it (training equals one process, each rank saves
and loads its rows, EP), on CPU in tests/test_local_ranks.py and on the GPU in benchmarks/gpu_check.py.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..runtime import collectives, distributed

_serial = threading.RLock()
DEFAULT_TIMEOUT_S = 600.0
# After a rank fails, how long the others get to end: one in a collective is woken at once, one in a group's
# creation (a store barrier, which nothing wakes) is left behind, the failure raised anyway.
FAILED_GRACE_S = 10.0


def one_at_a_time() -> threading.RLock:
    """A lock the ranks of a run share: `with one_at_a_time(): model = build(seed)` builds it as one process
    would (the random generator is the process's, not each rank's)."""
    return _serial


def refuse_device(device: str) -> None:
    """What a device needs for thread-ranks, refused by name before any thread starts."""
    if device == "cpu":
        return
    if device != "cuda":
        raise ValueError(f"`device`={device!r} must be 'cpu' or 'cuda'.")
    if not torch.cuda.is_available():
        raise ValueError("`device`='cuda' but torch sees no GPU here; run the ranks with device='cpu'.")
    if os.environ.get("CUDA_LAUNCH_BLOCKING") != "1":
        raise ValueError("`device`='cuda' needs CUDA_LAUNCH_BLOCKING=1 in the environment before CUDA starts: torch's "
                         "threaded process group copies every rank's data on rank 0's CUDA stream, which the other "
                         "ranks' streams do not wait for (tools/local_ranks.py). Start the process with it set.")


def run_local_ranks(fn: Callable[..., Any], world_size: int, *args: Any, device: str = "cpu",
                    timeout_s: float = DEFAULT_TIMEOUT_S, **kwargs: Any) -> list[Any]:
    """`fn(rank, world_size, *args, **kwargs)` on `world_size` threads of this process, each one rank under torch's
    threaded process group, sharding on `device`; what each returned, in rank order.

    A rank that raises wakes the others out of their collectives (they stop), and its exception is raised here
    once every thread has ended (or `FAILED_GRACE_S` later, the ones still waiting named), the lowest failed
    rank's, with the others' named in the message. No rank ending within `timeout_s`: TimeoutError."""
    from torch.testing._internal.distributed.multi_threaded_pg import (ProcessLocalGroup, _install_threaded_pg,
                                                                       _uninstall_threaded_pg)

    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"`world_size`={world_size!r} must be a positive integer.")
    if dist.is_initialized():
        raise ValueError("a process group already exists in this thread: the threaded ranks replace the process's "
                         "process groups while they run; call run_local_ranks from a process without one.")
    refuse_device(device)
    cuda_index = torch.cuda.current_device() if device == "cuda" else None
    results: list[Any] = [None] * world_size
    failures: dict[int, BaseException] = {}
    store = dist.HashStore()

    def rank_main(rank: int) -> None:
        try:
            if cuda_index is not None:
                torch.cuda.set_device(cuda_index)  # the current device is per thread
            dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
            results[rank] = fn(rank, world_size, *args, **kwargs)
        except BaseException as error:  # noqa: BLE001 - every rank's failure is reported, SystemExit included
            failures[rank] = error
            ProcessLocalGroup.exception_handle(error)  # the others' waits end (they raise SystemExit)
        finally:
            if dist.is_initialized():
                collectives.forget_host_groups()
                # torch 2.11's threaded world lacks the `comms` its destroy_process_group reads (AttributeError);
                # there the thread's world (a threading.local) goes with the thread
                if hasattr(dist.distributed_c10d._world, "comms"):
                    dist.destroy_process_group()

    # c10d's group names resolve per thread while isolation is on (torch's MultiThreadedTestCase does the same).
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    _install_threaded_pg()
    threads = [threading.Thread(target=rank_main, args=(r,), name=f"local-rank-{r}", daemon=True)
               for r in range(world_size)]
    try:
        with distributed.threads_shard_on(device):
            for thread in threads:
                thread.start()
            deadline, failed_at = time.monotonic() + timeout_s, None
            alive = threads
            while alive and time.monotonic() < deadline:
                alive[0].join(0.05)
                alive = [t for t in threads if t.is_alive()]
                if failures and failed_at is None:
                    failed_at = time.monotonic()
                if failed_at is not None and time.monotonic() - failed_at > FAILED_GRACE_S:
                    break  # a rank waiting where the failure cannot wake it (a group's creation barrier)
            stuck = [r for r, t in enumerate(threads) if t.is_alive()]
            if stuck:
                ProcessLocalGroup.exception_handle(TimeoutError())
                for thread in threads:
                    thread.join(1.0)
    finally:
        ProcessLocalGroup.reset()
        _uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    if stuck and not failures:
        raise TimeoutError(f"ranks {stuck} of {world_size} had not finished after {timeout_s:.0f} s.")
    if failures:
        # The first cause: a rank's own error, not the SystemExit the threaded group raises in the woken ones.
        causes = {r: e for r, e in failures.items() if not isinstance(e, SystemExit)} or failures
        first = min(causes)
        others = ", ".join(f"rank {r}: {type(e).__name__}" for r, e in sorted(failures.items()) if r != first)
        raise RuntimeError(f"rank {first} of {world_size} failed: {type(causes[first]).__name__}: {causes[first]}"
                           + (f" (also {others})" if others else "")
                           + (f"; ranks {stuck} still waiting (left behind)" if stuck else "")) from causes[first]
    return results


__all__ = ["DEFAULT_TIMEOUT_S", "FAILED_GRACE_S", "one_at_a_time", "refuse_device", "run_local_ranks"]
