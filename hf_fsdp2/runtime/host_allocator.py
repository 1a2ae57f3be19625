"""What the C library does with freed host memory: the one lever a CPU memory budget needs beyond the layout.

On CPU, torch's allocator is glibc's malloc. After the first large freed block, glibc raises its mmap
threshold (up to 32 MiB), so FSDP2's per-step all-gather outputs and unsharded parameters come from
the heap, and their pages stay with the process after `free` wherever live tensors sit above them
(benchmarks/README.md: a LoRA fine-tune planned at 318 MiB per rank held 676 MiB of RSS; with the
threshold fixed at 128 KiB, 341 MiB). `return_freed_blocks` fixes the thresholds (`mallopt`, which
also turns the dynamic adjustment off for the rest of the process): every block over 128 KiB is
mmapped and unmapped when freed, and free heap tops over 128 KiB are trimmed. The price is a page
fault per page of every fresh buffer each step (0.59-0.73x tokens/s at 58M parameters on the 2-core
CI machine), so the planner turns it on only when glibc's default would break the budget
(layout.LayoutPlan.returns_freed_memory). On GPUs the caching allocator reuses blocks and none of this applies.

Process-wide, so scoped: the lever is held for the models that needed it (`return_freed_blocks(owner)`) and
let go when the last of them is garbage-collected, or at `hf_fsdp2.unregister()`. glibc has no call that
turns its dynamic threshold back on, so letting go fixes the thresholds where that adjustment ends up
after large frees (32 MiB mmap threshold, twice that for trimming: glibc's DEFAULT_MMAP_THRESHOLD_MAX):
buffers up to 32 MiB come from the heap again and are reused without page faults.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import weakref

# glibc's malloc.h
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
RETURN_THRESHOLD_BYTES = 128 * 1024  # glibc's own initial mmap threshold
# Where glibc's dynamic adjustment takes the thresholds after large frees (malloc.c: DEFAULT_MMAP_THRESHOLD_MAX,
# 4 * 1024 * 1024 * sizeof(long) on 64-bit; the trim threshold follows at twice the mmap threshold).
RELEASED_MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
RELEASED_TRIM_THRESHOLD_BYTES = 2 * RELEASED_MMAP_THRESHOLD_BYTES
# Blocks under this come from glibc's heap by default (the dynamic mmap threshold never rises past it), and
# freed heap blocks stay with the process: the planner's measure of what the heap may keep (planner/memory.py).
HEAP_BLOCK_LIMIT = RELEASED_MMAP_THRESHOLD_BYTES

_returning = False
_owners: set[int] = set()  # id() of the models the lever is held for (each with a finalizer)


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """glibc, or None on another C library (musl, macOS), whose policies this module does not know."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()
        return libc
    except (OSError, AttributeError):
        return None


def is_glibc() -> bool:
    return _glibc() is not None


def returns_freed_blocks() -> bool:
    """Whether `return_freed_blocks` is in force in this process."""
    return _returning


def return_freed_blocks(owner: object | None = None) -> bool:
    """Make glibc give freed blocks over 128 KiB back to the OS, and trim what is free now, until `owner`
    (the model that needs it; None: until `release`) is garbage-collected along with every other owner.
    False (nothing changed) when the C library is not glibc."""
    global _returning
    libc = _glibc()
    if libc is None:
        return False
    if not _returning:
        _set_thresholds(libc, RETURN_THRESHOLD_BYTES, RETURN_THRESHOLD_BYTES)
        _returning = True
    if owner is not None and id(owner) not in _owners:
        _owners.add(id(owner))
        weakref.finalize(owner, _owner_gone, id(owner))
    trim()
    return True


def release() -> None:
    """Let the lever go now, whatever holds it (`hf_fsdp2.unregister()`): the thresholds where glibc's own
    adjustment would have taken them (module docstring)."""
    global _returning
    libc = _glibc()
    _owners.clear()
    if libc is None or not _returning:
        return
    _set_thresholds(libc, RELEASED_MMAP_THRESHOLD_BYTES, RELEASED_TRIM_THRESHOLD_BYTES)
    _returning = False


def _owner_gone(owner_id: int) -> None:
    if owner_id in _owners:  # else let go already (release)
        _owners.discard(owner_id)
        if not _owners:
            release()


def _set_thresholds(libc, mmap_threshold: int, trim_threshold: int) -> None:
    if not (libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold) and libc.mallopt(M_TRIM_THRESHOLD, trim_threshold)):
        raise OSError(f"glibc's mallopt refused M_MMAP_THRESHOLD={mmap_threshold} / M_TRIM_THRESHOLD={trim_threshold}")


def trim() -> None:
    """Give the heap's free pages back to the OS now (`malloc_trim(0)`); nothing on another C library."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def trim_if_returning() -> None:
    """Under `return_freed_blocks`: give back what is free now, such as a whole model's heap blocks freed
    when it was sharded (blocks allocated before the thresholds were fixed stay in the heap when freed)."""
    if _returning:
        trim()


__all__ = ["HEAP_BLOCK_LIMIT", "is_glibc", "release", "return_freed_blocks", "returns_freed_blocks", "trim", "trim_if_returning"]
