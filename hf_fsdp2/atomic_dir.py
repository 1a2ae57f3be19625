"""Atomic directory commits for multi-rank saves, and failure agreement between ranks.

Every rank writes into a hidden staging sibling of the target; once all ranks agree that their
writes succeeded, rank 0 swaps the staging directory in with renames. A crash at any point leaves
either the previous directory or the new one, never a mix, and the next save repairs the leftovers
(`recover`). Foreign files in the target (a tokenizer, a README, `checkpoint-*` folders) are moved
into the new directory, not lost.
"""

from __future__ import annotations

import contextlib
import errno as errno_codes
import os
import shutil
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist

STAGING_SUFFIX = ".hf_fsdp2-staging"
OLD_SUFFIX = ".hf_fsdp2-old"


def staging_path(target: Path) -> Path:
    return target.parent / f".{target.name}{STAGING_SUFFIX}"


def old_path(target: Path) -> Path:
    return target.parent / f".{target.name}{OLD_SUFFIX}"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def agree(error: BaseException | None, what: str) -> None:
    """Raise on every rank if any rank failed; the failing rank re-raises its own error.

    The only collective is an all-reduce of one integer (an errno, or 1), so a failure on one rank
    becomes a clear error everywhere instead of a hang at the next barrier.
    Collective: call on every rank.
    """
    code = 0
    if error is not None:
        code = getattr(error, "errno", None) or 1
    if dist.is_initialized():
        flag = torch.tensor([code], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        code = int(flag.item())
    if error is not None:
        raise error
    if code:
        reason = os.strerror(code) if code in errno_codes.errorcode else "see that rank's error"
        raise RuntimeError(f"another rank failed while {what} ({reason}); nothing was committed.")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def recover(target: Path, is_ours: Callable[[str], bool]) -> None:
    """Repair what a crashed commit of `target` left behind. Run by one process only.

    Commit order is: move foreign entries into staging, rename target -> old, staging -> target,
    delete old. So: old without target means staging is complete (finish the swap); staging beside
    a target means the save never committed (give foreign entries back, drop the rest).
    """
    staging, old = staging_path(target), old_path(target)
    if old.exists() and not target.exists() and staging.exists():
        os.rename(staging, target)
    elif staging.exists():
        if target.exists():
            for entry in staging.iterdir():
                if not is_ours(entry.name) and not (target / entry.name).exists():
                    os.rename(entry, target / entry.name)
        shutil.rmtree(staging)
    if old.exists():
        if target.exists():
            shutil.rmtree(old)
        else:  # only old survives (staging vanished): put it back
            os.rename(old, target)


@contextlib.contextmanager
def committed_directory(target: str | os.PathLike, *, is_ours: Callable[[str], bool],
                        keep_foreign: bool = True, what: str = "saving", durable: bool = True) -> Iterator[Path]:
    """Yield a staging directory on every rank; commit it as `target` when every rank succeeded.

    `is_ours(name)`: names this save writes (old copies of them are replaced, not kept).
    `durable=False`: no directory fsyncs (the commit is atomic for crashes of processes, not of the machine).
    Collective: call on every rank.
    """
    target = Path(target).absolute()
    staging = staging_path(target)
    error: BaseException | None = None
    if _rank() == 0:
        try:
            if target.exists() and not target.is_dir():
                raise NotADirectoryError(errno_codes.ENOTDIR, f"{target} exists and is not a directory")
            target.parent.mkdir(parents=True, exist_ok=True)
            recover(target, is_ours)
            staging.mkdir()
        except OSError as e:
            error = e
    agree(error, f"preparing {target}")
    error = None
    try:
        yield staging
    except BaseException as e:  # noqa: BLE001 - every rank must learn about it
        error = e
    try:
        agree(error, f"{what} {target}")
    except BaseException:
        if _rank() == 0:
            shutil.rmtree(staging, ignore_errors=True)  # the previous `target` is untouched
        raise
    if _rank() == 0:
        try:
            _swap_in(staging, target, is_ours, keep_foreign, durable)
        except OSError as e:
            error = e
    agree(error, f"committing {target}")


def _swap_in(staging: Path, target: Path, is_ours: Callable[[str], bool], keep_foreign: bool,
             durable: bool) -> None:
    if durable:
        fsync_dir(staging)
    old = old_path(target)
    if target.exists():
        if keep_foreign:
            for entry in target.iterdir():
                if not is_ours(entry.name) and not (staging / entry.name).exists():
                    os.rename(entry, staging / entry.name)
        os.rename(target, old)
    os.rename(staging, target)
    if durable:
        fsync_dir(target.parent)
    if old.exists():
        shutil.rmtree(old)
