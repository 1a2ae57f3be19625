"""Asynchronous saves: training waits only for a copy of its own rows.

A save with `blocking=False` (`save_state`, `save_pretrained`) runs in two parts:

1. On the calling thread, now: each rank copies the rows it writes into host staging memory
   (`StagingPool`: one buffer per tensor, reused from save to save, pinned when the tensors live on
   CUDA, so the staging costs one copy of the rank's shard of what is saved), and rank 0 renders
   the small files (configs, the Trainer's state, a tokenizer) into memory.
2. On one background thread: the files are written (and fsynced), the ranks agree that every rank
   succeeded, and the directory is committed by the same atomic rename as a blocking save.

The agreement in (2) runs on a separate gloo process group created once (collectively, by the first
asynchronous save), never on the training's group: collectives issued from a background thread on
the training's group would interleave with the training's own and pair up wrongly across ranks.

One save is in flight at a time: every save (blocking or not) first waits for the previous one. A
failure in the background (disk full, a rank killed) is raised by `SaveHandle.wait()`, or else by
the next save, on every rank (all ranks take part in the agreement); the previous complete
checkpoint is untouched and is what `latest_state` returns. At exit the process waits for a pending
save; if it failed, it says so on stderr and exits with status 1 instead of reporting success.
`torch.distributed.destroy_process_group` (which would destroy the agreement group under a pending
save) is wrapped, from the first asynchronous save on, to wait for the save first.
"""

from __future__ import annotations

import atexit
import functools
import os
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from ..runtime import collectives, upstream
from .safetensors_io import TensorSpec


@dataclass(frozen=True)
class StagedTensor:
    """A file tensor's rows this rank writes, already copied off the live parameters. Quacks like
    `ExportTensor` for `write_tensors` (name, spec, rows(), cols(), block())."""

    name: str
    spec: TensorSpec
    start: int
    stop: int
    data: torch.Tensor | None  # None when this rank writes no rows of it
    columns: tuple[int, int] | None = None  # ExportTensor.cols()

    def rows(self) -> tuple[int, int]:
        return self.start, self.stop

    def cols(self) -> tuple[int, int] | None:
        return self.columns

    def block(self) -> torch.Tensor:
        assert self.data is not None, f"{self.name}: this rank writes no rows"
        return self.data


class StagingPool:
    """Host buffers for staged rows, kept between saves (allocating and pinning memory every save
    would cost more than the copy)."""

    def __init__(self) -> None:
        self._staging_buffers: dict[tuple[str, str], torch.Tensor] = {}

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._staging_buffers.values())

    def stage(self, items: Sequence, kind: str) -> list[StagedTensor]:
        """Copy this rank's rows of every item (an `ExportTensor`) into the pool."""
        staged, on_cuda = [], False
        with torch.no_grad():
            for item in items:
                start, stop = item.rows()
                if stop <= start:
                    staged.append(StagedTensor(item.name, item.spec, start, stop, None))
                    continue
                source = item.block()
                key = (kind, item.name)
                buffer = self._staging_buffers.get(key)
                if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
                    buffer = torch.empty(source.shape, dtype=source.dtype, device="cpu", pin_memory=source.is_cuda)
                    self._staging_buffers[key] = buffer
                buffer.copy_(source, non_blocking=source.is_cuda)
                on_cuda = on_cuda or source.is_cuda
                staged.append(StagedTensor(item.name, item.spec, start, stop, buffer, item.cols()))
        if on_cuda:
            torch.cuda.current_stream().synchronize()  # the copies are in the buffers before training goes on
        return staged


def capture_files(write: Callable[[Path], None]) -> dict[str, bytes]:
    """Run `write(directory)` into a scratch directory now; its files, by relative path."""
    with tempfile.TemporaryDirectory(prefix="hf_fsdp2-async-") as scratch:
        root = Path(scratch)
        write(root)
        return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def write_captured(files: dict[str, bytes], directory: Path, durable: bool) -> None:
    for relative, data in files.items():
        path = directory / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())


def _lower_priority() -> None:
    """Run the background writer at the lowest CPU priority (Linux: per-thread nice 19), so that where
    cores are scarce the training threads keep them and the write takes what is left."""
    if sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError:
            pass


class SaveHandle:
    """A save running in the background. `wait()` returns its directory or raises its error."""

    def __init__(self, directory: Path, work: Callable[[], None]):
        self.directory = directory
        self._error: BaseException | None = None
        self._reported = False
        self._thread = threading.Thread(target=self._run, args=(work,), name="hf_fsdp2-async-save", daemon=True)
        self._thread.start()

    def _run(self, work: Callable[[], None]) -> None:
        try:
            _lower_priority()
            work()
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits
            self._error = e

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> Path:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the background save of {self.directory} is still running after {timeout} s")
        if self._error is not None:
            self._reported = True
            raise self._error
        return self.directory

    def __repr__(self) -> str:
        state = "running" if not self.done() else ("failed" if self._error else "committed")
        return f"SaveHandle({str(self.directory)!r}, {state})"


@dataclass
class _BackgroundSaves:
    """This process's one line of background saves: the staging buffers they reuse, the save in
    flight, and whether the exit wait and the `destroy_process_group` wrapper are installed."""

    pool: StagingPool = field(default_factory=StagingPool)
    pending: SaveHandle | None = None
    exit_hook_installed: bool = False


_saves = _BackgroundSaves()


def staging_pool() -> StagingPool:
    return _saves.pool


def wait_pending() -> None:
    """Wait for the save in flight, if any; raise its error unless its `wait()` already did."""
    handle, _saves.pending = _saves.pending, None
    if handle is None:
        return
    already_reported = handle._reported
    try:
        handle.wait()
    except BaseException:
        if not already_reported:
            raise


GROUP = "background-saves"  # the upstream.py group of the destroy_process_group wrapper
AGREEMENT_GROUP = "background-saves"  # the host group background saves agree on (runtime/collectives.py)


def start(directory: Path, commit: Callable[..., None], items: dict[str, Sequence],
          small_files: Callable[[Path], None], durable: bool) -> SaveHandle:
    """Stage each list of `items` (by kind: buffers are reused per kind) and render rank 0's
    `small_files` now; then run `commit(staged_items_by_kind, write_small_files, group)` in the
    background. The caller has waited for the previous save (`wait_pending`)."""
    if collectives.in_process_backend() == "threaded":
        raise ValueError("a background save (`async_save`, `blocking=False`) is not done for ranks that are threads of "
                         "one process (tools/local_ranks.py): the pending save and its staging buffers are the "
                         "process's, one per process. Save with blocking=True / async_save=False there.")
    staged = {kind: _saves.pool.stage(kind_items, kind) for kind, kind_items in items.items()}
    try:
        files = capture_files(small_files) if collectives.rank() == 0 else {}
    except BaseException as error:
        # The other ranks' background commits are already on their way to the agreement: this rank's
        # commit goes there too and fails it, so they raise promptly instead of waiting for a timeout.
        cause = error  # `error` is unbound when the except block ends; the background thread raises later

        def fail(staging: Path) -> None:
            raise cause

        submit(directory, lambda group: commit(staged, fail, group))._reported = True  # raised here, now
        raise
    return submit(directory, lambda group: commit(
        staged, lambda staging: write_captured(files, staging, durable), group))


def submit(directory: Path, commit: Callable[[object], None]) -> SaveHandle:
    """Run `commit(group)` in the background (the previous save has been waited for by the caller)."""
    collectives.host_group(AGREEMENT_GROUP)  # created here, collectively, not in the background thread
    group = AGREEMENT_GROUP
    if not _saves.exit_hook_installed:
        atexit.register(_wait_at_exit)  # registered after exit_guard's, so it runs before it
        _wrap_destroy_process_group()
        _saves.exit_hook_installed = True
    _saves.pending = SaveHandle(directory, lambda: commit(group))
    return _saves.pending


def _wrap_destroy_process_group() -> None:
    """`dist.destroy_process_group()` (scripts end with it; so does `Accelerator.end_training`) also
    destroys the agreement group a pending save still needs: wait for the save first."""
    target = "torch.distributed.destroy_process_group"
    original = dist.destroy_process_group

    @functools.wraps(original)
    def destroy_process_group(group=None):
        wait_pending()
        if group is None:
            collectives.forget_host_groups()  # destroyed with the rest
        return upstream.original(target)(group)

    upstream.replace(target, destroy_process_group, GROUP)


def unregister() -> None:
    """Wait for a pending save, then give `dist.destroy_process_group` back (hf_fsdp2.unregister())."""
    wait_pending()
    upstream.restore(GROUP)
    _saves.exit_hook_installed = False


def _wait_at_exit() -> None:
    handle = _saves.pending
    if handle is None:
        return
    already_reported = handle._reported
    try:
        handle.wait()
    except BaseException as e:  # noqa: BLE001
        if not already_reported:
            print(f"hf_fsdp2: the background save of {handle.directory} failed: {type(e).__name__}: {e}. "
                  "Nothing of it was committed; the previous complete checkpoint is intact.", file=sys.stderr)
            sys.stderr.flush()
            os._exit(1)
