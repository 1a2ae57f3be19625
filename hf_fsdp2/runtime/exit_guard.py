"""A clean interpreter exit after gloo collectives.

The mechanism (torch 2.13, CPython 3.11; found with gdb on core dumps of `accelerate launch` runs):

1. A gloo collective runs on one of the process group's worker threads (`pt_gloo_runloop`). The
   worker completes the work's future, which wakes the caller, and only afterwards drops its own
   reference to the work (`ProcessGroupGloo::runLoop`: `workInProgress_[i].reset()` and the loop's
   local `work`). If the caller has already dropped the Python `Work`, that drop frees the work and
   its tensors.
2. A tensor with a live Python object whose C++ refcount falls from 2 to 1 releases that Python
   object (`c10::intrusive_ptr::reset_not_null_` -> `TensorImpl::decref_pyobject`), which takes
   the GIL, on the worker thread.
3. If the main thread has begun finalizing by then, CPython exits the thread that asks for the GIL
   (`PyThread_exit_thread` in `take_gil`). `pthread_exit` unwinds through a `noexcept` C++ frame,
   so the process calls `std::terminate`: "terminate called without an active exception", SIGABRT,
   exit code -6, after all the script's work is done. Any collective can be the last one: ours,
   FSDP2's, a DTensor redistribute (`get_state_dict`), Accelerate's, the Trainer's, the user's.

Why `destroy_process_group()` / `accelerator.end_training()` does not help: `ProcessGroupGloo`
does not override `Backend::shutdown()` (a no-op), so destroying the group only unregisters it. Its
worker threads, and a work they still hold, live until the C++ object is freed, which for a
sharded model (DeviceMesh, FSDP state and DTensors keep the group) happens during finalization,
where `~ProcessGroupGloo` releases the GIL to join the workers: exactly when a waiting worker
takes it and is killed. (PyTorch's attempt to destroy groups at exit, pytorch#179291, was
abandoned; it would not have helped here for that reason.)

The fix, once for every collective: an `atexit` handler (it runs while the interpreter is still
whole) that waits, with the GIL released, until every gloo worker thread is idle: asleep and
with unchanged context-switch counts over a quiet interval. A worker that still has to free a
tensor wakes (or is woken by the GIL release) within that interval, so it cannot look idle.
Installed on `import hf_fsdp2`; it costs one quiet interval (~20 ms) at exit, and nothing when no
gloo group exists. Without /proc (not Linux) it waits a fixed short time instead.
"""

from __future__ import annotations

import atexit
import time
from pathlib import Path

GLOO_WORKER_THREAD = "pt_gloo_runloop"  # c10::setThreadName in ProcessGroupGloo::runLoop
QUIET_S = 0.02       # longer than CPython's GIL wait interval (5 ms) and a scheduler slice
TIMEOUT_S = 10.0     # a collective still running at exit (a dead peer) is not waited for longer
_TASKS = Path("/proc/self/task")
_installed = False


def _worker_samples() -> dict[str, tuple[str, int, int]] | None:
    """{thread id: (state, voluntary, involuntary context switches)} of gloo worker threads;
    None where /proc cannot tell."""
    if not _TASKS.is_dir():
        return None
    samples = {}
    for task in _TASKS.iterdir():
        try:
            if (task / "comm").read_text().strip() != GLOO_WORKER_THREAD:
                continue
            fields = dict(line.split(":", 1) for line in (task / "status").read_text().splitlines() if ":" in line)
            samples[task.name] = (fields["State"].split()[0], int(fields["voluntary_ctxt_switches"]),
                                  int(fields["nonvoluntary_ctxt_switches"]))
        except (OSError, KeyError, ValueError):
            continue  # the thread ended while we looked
    return samples


def wait_for_gloo_workers(timeout: float = TIMEOUT_S) -> bool:
    """Block, with the GIL released, until no gloo worker thread has anything left to free.

    True when they were seen idle (or there are none), False after `timeout`.
    """
    before = _worker_samples()
    if before is None:
        time.sleep(0.1)  # no /proc: a fixed grace period, with the GIL released
        return True
    if not before:
        return True
    deadline = time.monotonic() + timeout
    while True:
        time.sleep(QUIET_S)  # releases the GIL: a worker waiting for it takes it now
        after = _worker_samples()
        if after == before and all(state == "S" for state, _, _ in after.values()):
            return True
        if time.monotonic() > deadline:
            return False
        before = after


def install() -> None:
    """Register the exit handler once per process (idempotent)."""
    global _installed
    if not _installed:
        atexit.register(wait_for_gloo_workers)
        _installed = True


def uninstall() -> None:
    global _installed
    atexit.unregister(wait_for_gloo_workers)
    _installed = False
