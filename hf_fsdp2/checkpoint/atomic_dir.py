"""Atomic directory commits for multi-rank saves, and failure agreement between ranks.

Every rank writes into a hidden staging sibling of the target; once all ranks agree that their
writes succeeded, rank 0 commits:

- Replaced: only what this save writes, plus the weights layout a previous save of the same
  weights name left (its single file, index and `-0000k-of-0000n` shards, as transformers'
  `save_pretrained` cleans them). Every other entry of the target (a tokenizer, a README,
  `model_ema.safetensors`, `checkpoint-*/`) is carried over unchanged: files are hard-linked into
  the new directory (same inode, bytes and mode), subdirectories moved.
- Swap: on Linux, `renameat2(RENAME_EXCHANGE)` exchanges staging and target in one step, so at
  every instant the target path is one complete checkpoint, then the old copy is deleted. Where
  the call or the filesystem lacks it, two renames (target -> old copy, staging -> target) leave
  a window of microseconds with no target; a crash inside it is repaired by the next save.
- A target that is a mount point cannot be renamed: staging then lives inside it and the entries
  are renamed in one by one (each file atomic, the set not: a reader can see a mix).
- A symlinked target is written through (the link stays); the directory's and files' modes of
  an overwritten checkpoint are kept; a symlink planted at a staging or old-copy name is refused.
- One writer per target: an advisory `flock` on `.<name>.hf_fsdp2-lock` in the parent (removed
  after the commit) makes a second concurrent save fail at once with a clear error.

A crash at any point leaves the previous checkpoint or the new one, never a mix, and the next save
repairs the leftovers (`recover`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno as errno_codes
import fcntl
import os
import re
import shutil
import stat
from pathlib import Path
from typing import Callable, Iterable, Iterator

from ..runtime import collectives

STAGING_SUFFIX = ".hf_fsdp2-staging"
OLD_SUFFIX = ".hf_fsdp2-old"
LOCK_SUFFIX = ".hf_fsdp2-lock"
IN_PLACE_STAGING = ".hf_fsdp2-staging"  # inside a mount-point target
_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


class TargetBusyError(RuntimeError):
    """Another job is saving into the same directory."""


def staging_path(target: Path) -> Path:
    return target.parent / f".{target.name}{STAGING_SUFFIX}"


def old_path(target: Path) -> Path:
    return target.parent / f".{target.name}{OLD_SUFFIX}"


def lock_path(target: Path) -> Path:
    return target.parent / f".{target.name}{LOCK_SUFFIX}"


def _error_code(error: BaseException) -> int:
    """A positive code for any failure: an errno where there is a real one, else 1.
    (`socket.gaierror.errno` is negative; it must still count as a failure in the MAX.)"""
    code = getattr(error, "errno", None)
    return code if isinstance(code, int) and 0 < code < 4096 else 1


# The code a rank sends when the directory was committed and only the work after the commit failed
# (above every errno, so the all-reduce's MAX keeps it).
AFTER_COMMIT_FAILED = 1 << 20


def agree(error: BaseException | None, what: str, group: str | None = None, *, committed: bool = False) -> None:
    """Raise on every rank if any rank failed; the failing rank re-raises its own error.

    The only collective is an all-reduce of one integer (an errno, or 1) on a host group
    (runtime/collectives.py; `group` names it: a background save agrees on its own), so a failure on
    one rank becomes a clear error everywhere instead of a hang at the next barrier. `committed`:
    `error` happened after the directory was committed (the other ranks are told so).
    Collective: call on every rank.
    """
    code = 0 if error is None else AFTER_COMMIT_FAILED if committed else _error_code(error)
    code = collectives.all_reduce_int(code, "max", purpose=group or "main")
    if error is not None:
        raise error
    if code == AFTER_COMMIT_FAILED:
        raise RuntimeError(f"{what}: the directory was committed, but the work after the commit failed on "
                           "rank 0 (see its error).")
    if code:
        reason = os.strerror(code) if code in errno_codes.errorcode else "see that rank's error"
        raise RuntimeError(f"another rank failed while {what} ({reason}); nothing was committed.")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under `root` (symlinks are not followed), deepest first, then
    `root`: whatever wrote them (transformers' config.json, a user's tokenizer, the ranks' shards), a
    committed directory survives a power loss whole. Files already synced cost a no-op fsync."""
    for directory, subdirs, files in os.walk(root, topdown=False):
        for name in files:
            path = os.path.join(directory, name)
            if not os.path.islink(path):
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        for name in subdirs:
            if not os.path.islink(os.path.join(directory, name)):
                fsync_dir(Path(directory, name))
    fsync_dir(root)


# ---------------------------------------------------------------------------------------------
# What a save replaces


def weights_family(weights_name: str) -> re.Pattern:
    """`model.safetensors`, its index and its `model-0000k-of-0000n.safetensors` shards."""
    stem, _, suffix = weights_name.rpartition(".")
    return re.compile(rf"{re.escape(weights_name)}(\.index\.json)?|{re.escape(stem)}-\d{{5}}-of-\d{{5}}\.{re.escape(suffix)}")


def replaced_by(written: Iterable[str], weights_names: Iterable[str]):
    """The predicate `name -> bool` of target entries a save that wrote `written` replaces."""
    written = set(written)
    families = [weights_family(w) for w in weights_names]
    return lambda name: name in written or any(f.fullmatch(name) for f in families)


# ---------------------------------------------------------------------------------------------
# Locking, recovery, the swap


def _refuse_link(path: Path) -> None:
    if path.is_symlink():
        raise FileExistsError(errno_codes.EEXIST, f"{path} is a symbolic link where hf_fsdp2 keeps its staging "
                              "copy; refusing to touch it (or what it points to). Remove it and save again.")


@contextlib.contextmanager
def target_lock(target: Path) -> Iterator[None]:
    """An exclusive, non-blocking `flock` on the target's lock file; busy -> `TargetBusyError`."""
    path = lock_path(target)
    _refuse_link(path)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # The holder unlinks the file when done: a lock on an unlinked inode is no lock.
            if os.stat(path, follow_symlinks=False).st_ino != os.fstat(fd).st_ino:
                raise BlockingIOError
        except (BlockingIOError, FileNotFoundError):
            raise TargetBusyError(f"{target} is being written by another job (it holds {path}); "
                                  "nothing was changed. Save elsewhere or wait for it to finish.") from None
        try:
            yield
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    finally:
        os.close(fd)


def recover(target: Path, replaced) -> None:
    """Repair what a crashed commit of `target` left behind. Run by one process, under the lock.

    A staging directory beside the target is either a save that never committed or, after an
    exchange, the previous copy: both are dropped, after giving back entries that are not
    replaced (foreign subdirectories moved into staging) and that the target lacks. An old copy
    without a target (the two-rename fallback crashed between its renames) is the last complete
    checkpoint when no staging exists, else staging is complete and finishes the swap.
    """
    staging, old = staging_path(target), old_path(target)
    _refuse_link(staging)
    _refuse_link(old)
    if old.exists() and not target.exists() and staging.exists():
        os.rename(staging, target)
    elif staging.exists():
        if target.exists():
            for entry in staging.iterdir():
                if not replaced(entry.name) and not os.path.lexists(target / entry.name):
                    os.rename(entry, target / entry.name)
        shutil.rmtree(staging)
    if old.exists():
        if target.exists():
            shutil.rmtree(old)
        else:  # only old survives (staging vanished): put it back
            os.rename(old, target)
    inside = target / IN_PLACE_STAGING
    if target.is_dir() and not target.is_symlink() and os.path.lexists(inside):
        _refuse_link(inside)
        shutil.rmtree(inside)


def rename_exchange(a: Path, b: Path) -> bool:
    """Atomically exchange two paths (Linux `renameat2`); False where unsupported."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno_codes.ENOSYS, errno_codes.EINVAL, errno_codes.ENOTSUP, errno_codes.EOPNOTSUPP):
        return False
    raise OSError(err, f"exchanging {a} and {b}: {os.strerror(err)}")


def is_mount_point(path: Path) -> bool:
    return path.is_dir() and os.path.ismount(path)


def _copy_modes(old: Path, new: Path, replaced) -> None:
    """Give the new directory and files the modes of the copy they replace (a private 0700/0600
    checkpoint stays private); new names take the mode of any replaced file."""
    os.chmod(new, stat.S_IMODE(os.stat(old).st_mode))
    old_modes, file_mode = {}, None
    for e in os.scandir(old):
        if replaced(e.name) and not e.is_symlink():
            old_modes[e.name] = stat.S_IMODE(e.stat(follow_symlinks=False).st_mode)
            if file_mode is None and e.is_file(follow_symlinks=False):
                file_mode = old_modes[e.name]
    for entry in os.scandir(new):
        if entry.is_symlink():
            continue
        mode = old_modes.get(entry.name, file_mode if entry.is_file() else None)
        if mode is not None:
            os.chmod(entry.path, mode)


def _carry_over(old: Path, new: Path, replaced) -> None:
    """Entries of `old` this save does not replace go into `new`: files hard-linked (both copies
    hold them until the swap), everything else moved."""
    for entry in old.iterdir():
        if replaced(entry.name) or entry.name == IN_PLACE_STAGING or os.path.lexists(new / entry.name):
            continue
        if entry.is_file() and not entry.is_symlink():
            try:
                os.link(entry, new / entry.name)
                continue
            except OSError:
                pass  # no hard links here: move it
        os.rename(entry, new / entry.name)


def swap_in(staging: Path, target: Path, replaced, durable: bool) -> None:
    """Make `staging` the new `target` (see the module docstring). Rank 0 only, under the lock."""
    if target.exists():
        _copy_modes(target, staging, replaced)
        _carry_over(target, staging, replaced)
    if durable:
        fsync_tree(staging)
    if not target.exists():
        os.rename(staging, target)
        previous = None
    elif rename_exchange(staging, target):
        previous = staging  # the exchange left the previous copy at the staging name
    else:
        previous = old_path(target)
        os.rename(target, previous)
        os.rename(staging, target)
    if durable:
        fsync_dir(target.parent)
    if previous is not None:
        shutil.rmtree(previous, ignore_errors=True)  # leftovers of a crash here: see `recover`


def swap_in_place(staging: Path, target: Path, replaced, durable: bool) -> None:
    """Commit a staging directory inside a mount-point target, entry by entry."""
    written = {entry.name for entry in staging.iterdir()}
    if durable:
        fsync_tree(staging)
    _copy_modes(target, staging, replaced)
    for entry in target.iterdir():  # stale files of ours (shards of a larger previous save)
        if replaced(entry.name) and entry.name not in written and entry.name != IN_PLACE_STAGING:
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    for name in sorted(written):
        source, dest = staging / name, target / name
        if source.is_dir() and dest.is_dir() and not dest.is_symlink():
            if not rename_exchange(source, dest):
                shutil.rmtree(dest)
                os.rename(source, dest)
                continue
            shutil.rmtree(source)
        else:
            os.replace(source, dest)
    os.rmdir(staging)
    if durable:
        fsync_dir(target)


def _resolve(target: str | os.PathLike) -> Path:
    """The directory to replace: a symlinked target is written through to what it points to."""
    path = Path(target).absolute()
    return Path(os.path.realpath(path)) if path.is_symlink() else path


@contextlib.contextmanager
def committed_directory(target: str | os.PathLike, *, weights_names: Iterable[str] = (), what: str = "saving",
                        durable: bool = True, group: str | None = None,
                        after_commit: Callable[[], None] | None = None) -> Iterator[Path]:
    """Yield a staging directory on every rank; commit it as `target` when every rank succeeded.

    `weights_names`: the weights files this save writes (their previous layouts are replaced too).
    Any exception on any rank, of any type, leaves the previous `target` as it was and raises on
    every rank. `durable=False`: no fsyncs (atomic for crashes of processes, not of the machine).
    `group`: the name of the host group the ranks agree on (see `agree`). `after_commit()`: runs on rank 0 once
    the new `target` is in place (still under the target's lock), e.g. rotating older checkpoints; its
    failure is raised on every rank by the commit's own agreement (the new `target` stays).
    Collective: call on every rank.
    """
    target = _resolve(target)
    weights_names = tuple(weights_names)
    # A mount point cannot be renamed, so it stages inside itself (every rank sees the same filesystem).
    staging = target / IN_PLACE_STAGING if is_mount_point(target) else staging_path(target)
    error: BaseException | None = None
    with contextlib.ExitStack() as stack:
        if collectives.rank() == 0:
            try:
                if target.exists() and not target.is_dir():
                    raise NotADirectoryError(errno_codes.ENOTDIR, f"{target} exists and is not a directory")
                target.parent.mkdir(parents=True, exist_ok=True)
                stack.enter_context(target_lock(target))
                recover(target, replaced_by((), weights_names))
                staging.mkdir()
            except BaseException as e:  # noqa: BLE001 - every rank must learn about it
                error = e
        agree(error, f"preparing {target}", group)
        try:
            yield staging
        except BaseException as e:  # noqa: BLE001 - every rank must learn about it
            error = e
        try:
            agree(error, f"{what} {target}", group)
        except BaseException:
            if collectives.rank() == 0:
                shutil.rmtree(staging, ignore_errors=True)  # the previous `target` is untouched
            raise
        committed = False
        if collectives.rank() == 0:
            replaced = replaced_by((e.name for e in staging.iterdir()), weights_names)
            try:
                (swap_in_place if staging.parent == target else swap_in)(staging, target, replaced, durable)
            except BaseException as e:  # noqa: BLE001
                error = e
                with contextlib.suppress(Exception):
                    recover(target, replaced)  # back to one complete copy: the previous or the new
            else:
                if after_commit is not None:
                    try:
                        after_commit()
                    except BaseException as e:  # noqa: BLE001 - every rank must learn about it
                        error, committed = e, True
        agree(error, f"committing {target}", group, committed=committed)
