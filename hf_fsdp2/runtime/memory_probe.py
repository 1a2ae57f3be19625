"""What this process holds, read from Linux's /proc and glibc: RSS, its high-water mark (resettable), and
glibc's own count of live heap bytes; a thread that samples them. CUDA's own counters need no probe
(`torch.cuda.max_memory_allocated`). Used by `hf-fsdp2 simulate` (tools/simulate.py) and the benchmarks
(benchmarks/harness.py re-exports these)."""

from __future__ import annotations

import ctypes
import functools
import threading


def status_bytes(*fields: str) -> dict[str, int]:
    """`/proc/self/status` fields (e.g. "VmRSS", "VmHWM", "RssAnon") in bytes; absent ones are left out."""
    wanted = {f.encode() + b":" for f in fields}
    out = {}
    with open("/proc/self/status", "rb") as f:
        for line in f:
            key = line.split(b":", 1)[0] + b":"
            if key in wanted:
                out[key[:-1].decode()] = int(line.split()[1]) * 1024
    return out


def rss_bytes() -> int:
    return status_bytes("VmRSS")["VmRSS"]


def hwm_bytes() -> int:
    return status_bytes("VmHWM")["VmHWM"]


def reset_hwm() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False when not permitted."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class _MallInfo2(ctypes.Structure):  # glibc >= 2.33's struct mallinfo2 (malloc.h)
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


@functools.cache
def _mallinfo2():
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        return libc.mallinfo2
    except (OSError, AttributeError):
        return None


def malloc_bytes() -> dict[str, int] | None:
    """glibc's own count, all arenas: `live` (in use: heap chunks + mmapped blocks), `heap_free` (free chunks
    the heap keeps: RSS beyond the live bytes, where touched); None on another C library."""
    info = _mallinfo2()
    if info is None:
        return None
    m = info()
    return {"live": m.uordblks + m.hblkhd, "heap_free": m.fordblks}


def _status_field(data: bytes, key: bytes) -> int:
    """A /proc/self/status field's bytes from its text (0 when absent)."""
    i = data.find(key)
    return int(data[i + len(key):data.index(b"kB", i)].strip()) * 1024 if i >= 0 else 0


class RssSampler:
    """Max VmRSS (`max`) and max RssAnon (`max_anon`) seen by a thread polling /proc/self/status
    every `interval` seconds; `samples` counts the polls. `malloc=True`: also the max of glibc's live
    bytes (`max_live`) and the heap's free bytes at the RSS maximum (`heap_free_at_max`)."""

    def __init__(self, interval: float = 0.005, malloc: bool = False):
        self.interval = interval
        self.malloc = malloc and _mallinfo2() is not None
        self.max = self.max_anon = self.samples = 0
        self.max_live = self.heap_free_at_max = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with open("/proc/self/status", "rb", buffering=0) as f:
            while True:
                f.seek(0)
                data = f.read(8192)
                rss, anon = (_status_field(data, key) for key in (b"VmRSS:", b"RssAnon:"))
                new_max = rss > self.max
                self.max, self.max_anon = max(self.max, rss), max(self.max_anon, anon)
                if self.malloc:
                    m = malloc_bytes()
                    self.max_live = max(self.max_live, m["live"])
                    if new_max:
                        self.heap_free_at_max = m["heap_free"]
                self.samples += 1
                if self._stop.wait(self.interval):
                    return

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
