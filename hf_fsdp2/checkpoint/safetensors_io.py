"""Safetensors files written and read by row blocks, with no gather.

A dim-0 block of rows of a row-major tensor is one contiguous byte range of the file, so every rank
can `pwrite` its own rows at `data_start + tensor_begin + first_row * row_bytes`. The header is
computed identically on every rank from global names, dtypes and shapes (`plan_file`), so no rank
needs to talk to another; reading is the mirror (`read_rows`). Format: 8-byte little-endian header
length, a JSON header padded with spaces to 8 bytes, then the data section, which must cover the
rest of the file exactly (safetensors refuses anything else).

This module knows nothing about models or torch.distributed.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, NamedTuple, Sequence

import torch

from ..config import parse_bytes
from .errors import CheckpointError
from .header import LIMIT, parse_header

_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
_FROM_NAME = {v: k for k, v in _DTYPES.items()}
_MAX_HEADER = 100_000_000  # safetensors refuses larger headers
# Bound on the bytes cast/copied at once while writing a block, so extra RSS stays small.
WRITE_CHUNK_BYTES = 16 * 1024 * 1024
SINGLE_FILE = "model.safetensors"
INDEX_SUFFIX = ".index.json"


MAX_JSON_BYTES = 256 * 1024 * 1024  # an index of 400,000 tensors is ~40 MB


def open_regular(path: Path, dir_fd: int | None = None) -> int:
    """A read-only fd on `path` (relative to `dir_fd` if given), for regular files only: a FIFO or a
    device would block or never end, so it is refused with an error naming the file."""
    try:
        fd = os.open(path.name if dir_fd is not None else path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=dir_fd)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found.") from None
    except OSError as e:  # no permission, a loop of links, ...
        raise CheckpointError(f"{path}: cannot be read ({e.strerror}).") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"{path}: not a regular file (a directory, FIFO or device); refused.")
    os.set_blocking(fd, True)
    return fd


def read_bounded(path: Path, dir_fd: int | None = None, *, limit: int = MAX_JSON_BYTES) -> bytes:
    """The bytes of a regular file of at most `limit` bytes; else a `CheckpointError` naming it."""
    fd = open_regular(path, dir_fd)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise CheckpointError(f"{path}: {size} bytes, more than the {limit} a JSON file here may have.")
        return os.pread(fd, size + 1, 0)
    finally:
        os.close(fd)


def read_json_file(path: Path, dir_fd: int | None = None, *, limit: int = MAX_JSON_BYTES) -> object:
    """Parse a JSON file of at most `limit` bytes; any problem (missing, not a regular file, too large,
    not UTF-8 JSON, nested too deeply) is a `CheckpointError` naming the file."""
    raw = read_bounded(path, dir_fd, limit=limit)
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeError, ValueError) as e:  # JSONDecodeError is a ValueError
        raise CheckpointError(f"{path}: not valid JSON ({e}).") from None
    except RecursionError:
        raise CheckpointError(f"{path}: JSON nested too deeply.") from None


class TensorSpec(NamedTuple):  # a tuple, not a dataclass: read_layout builds 400,000 of them at C speed
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def row_bytes(self) -> int:
        """Bytes of one dim-0 row (the whole tensor for a scalar)."""
        return self.nbytes // self.shape[0] if self.shape and self.shape[0] else self.nbytes


@dataclass(frozen=True)
class FileLayout:
    """Where each tensor of one safetensors file lives. Identical on every rank for the same specs."""

    filename: str
    header: bytes  # length prefix + padded JSON
    begins: Mapping[str, int]  # absolute file offset of each tensor's first byte
    specs: Mapping[str, TensorSpec]
    size: int

    def row_offset(self, name: str, row: int) -> int:
        spec = self.specs[name]
        return self.begins[name] + row * spec.row_bytes


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in _DTYPES:
        raise TypeError(f"dtype {dtype} cannot be stored in safetensors; cast it first.")
    return _DTYPES[dtype]


def plan_file(filename: str, specs: Sequence[TensorSpec], metadata: Mapping[str, str] | None = None) -> FileLayout:
    """The header and byte offsets of a file holding `specs` in the given order."""
    header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
    begins_rel: dict[str, int] = {}
    cursor = 0
    for spec in specs:
        if spec.name in header or spec.name == "__metadata__":
            raise ValueError(f"tensor name {spec.name!r} appears twice in {filename}.")
        header[spec.name] = {"dtype": dtype_name(spec.dtype), "shape": list(spec.shape),
                             "data_offsets": [cursor, cursor + spec.nbytes]}
        begins_rel[spec.name] = cursor
        cursor += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    prefix = struct.pack("<Q", len(raw)) + raw
    start = len(prefix)
    return FileLayout(filename=filename, header=prefix, begins={k: start + v for k, v in begins_rel.items()},
                      specs={s.name: s for s in specs}, size=start + cursor)


def parse_size(size: int | str) -> int:
    """"5GB" -> 5 * 10**9, "500MiB" -> 500 * 2**20, ints pass through (the units transformers uses);
    config.parse_bytes, the one size parser."""
    return parse_bytes(size, "max_shard_size")


def plan_checkpoint(specs: Sequence[TensorSpec], max_shard_size: int | str = "5GB",
                    weights_name: str = SINGLE_FILE) -> tuple[list[FileLayout], dict | None]:
    """Split `specs` (in order) into files of at most `max_shard_size` bytes, like transformers does.

    Returns the layouts and, when there is more than one file, the index (`weight_map`, `total_size`).
    """
    limit = parse_size(max_shard_size)
    groups: list[list[TensorSpec]] = [[]]
    used = 0
    for spec in specs:
        if groups[-1] and used + spec.nbytes > limit:
            groups.append([])
            used = 0
        groups[-1].append(spec)
        used += spec.nbytes
    if len(groups) == 1:
        return [plan_file(weights_name, groups[0])], None
    stem, ext = weights_name.rsplit(".", 1)
    n = len(groups)
    layouts = [plan_file(f"{stem}-{i + 1:05d}-of-{n:05d}.{ext}", g) for i, g in enumerate(groups)]
    index = {
        "metadata": {"total_size": sum(s.nbytes for s in specs)},
        "weight_map": {s.name: layout.filename for layout in layouts for s in layout.specs.values()},
    }
    return layouts, index


# ---------------------------------------------------------------------------------------------
# Writing


class FileWriter:
    """Writes row blocks into one planned file. Any number of processes may hold one at once.

    `create=True` (one process per file) writes the header and sets the final size; no one truncates,
    so writers that open the file before or after that never lose each other's bytes.
    `durable=False` skips the fsync on close (the bytes survive a crash of the process, not of the
    machine).
    """

    def __init__(self, path: str | os.PathLike, layout: FileLayout, *, create: bool, durable: bool = True):
        self.path = Path(path)
        self.layout = layout
        self.durable = durable
        self._staging: torch.Tensor | None = None  # see `_host_chunk`
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            if create:
                _pwrite_all(self.fd, memoryview(layout.header), 0, self.path)
                os.ftruncate(self.fd, layout.size)
        except BaseException:
            os.close(self.fd)
            raise

    def write_rows(self, name: str, first_row: int, block: torch.Tensor) -> int:
        """Write `block` (rows `first_row`.. of tensor `name`), cast to the planned dtype in small chunks.

        Returns the bytes written.
        """
        spec = self.layout.specs[name]
        rows = block.shape[0] if block.dim() else 1
        assert tuple(block.shape[1:]) == spec.shape[1:] and first_row + rows <= (
            spec.shape[0] if spec.shape else 1), (name, tuple(block.shape), first_row, spec.shape)
        if block.numel() == 0:
            return 0
        flat_rows = block.reshape(rows, -1)
        rows_per_chunk = max(1, WRITE_CHUNK_BYTES // max(spec.row_bytes, 1))
        offset = self.layout.row_offset(name, first_row)
        written = 0
        for start in range(0, flat_rows.shape[0], rows_per_chunk):
            chunk = self._host_chunk(flat_rows[start:start + rows_per_chunk], spec.dtype)
            data = memoryview(chunk.view(torch.uint8).numpy()).cast("B")
            _pwrite_all(self.fd, data, offset + written, self.path)
            written += len(data)
        return written

    def _host_chunk(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`rows` on the host in `dtype`: the rows themselves when they already are (a CPU shard in its
        file dtype), else copied into one staging buffer this writer reuses for every chunk, pinned when
        the rows are on a GPU. A fresh host tensor per chunk (`.to("cpu")`) is fresh pages, faulted in on
        every save: on the H200 a 4.94 GB save ran at 0.51x the disk's write+fsync with them
        (benchmarks/results/gpu_check-20261127T1820Z-H200.json). The copy is synchronous, so the buffer
        may be written from, and reused, as soon as it returns."""
        if rows.device.type == "cpu" and rows.dtype == dtype:
            return rows.contiguous()
        nbytes = rows.numel() * dtype.itemsize
        if self._staging is None or self._staging.numel() < nbytes:
            pinned = rows.device.type == "cuda"
            self._staging = torch.empty(max(nbytes, WRITE_CHUNK_BYTES), dtype=torch.uint8,
                                        pin_memory=pinned)
        return self._staging[:nbytes].view(dtype).view(rows.shape).copy_(rows)

    def write_block(self, name: str, first_row: int, cols: tuple[int, int] | None, block: torch.Tensor) -> int:
        """`write_rows`, or only columns `cols` of those rows (a tensor-parallel rowwise split): one
        write per row, each at its row's offset plus the first column's. Returns the bytes written."""
        if cols is None:
            return self.write_rows(name, first_row, block)
        spec = self.layout.specs[name]
        first, stop = cols
        assert len(spec.shape) == 2 and block.dim() == 2 and block.shape[1] == stop - first, (name, cols, block.shape)
        item = spec.dtype.itemsize
        written = 0
        rows_per_chunk = max(1, WRITE_CHUNK_BYTES // max(block.shape[1] * item, 1))
        for start in range(0, block.shape[0], rows_per_chunk):
            chunk = self._host_chunk(block[start:start + rows_per_chunk], spec.dtype)
            data = memoryview(chunk.view(torch.uint8).numpy()).cast("B")
            width = chunk.shape[1] * item
            for i in range(chunk.shape[0]):
                offset = self.layout.row_offset(name, first_row + start + i) + first * item
                _pwrite_all(self.fd, data[i * width:(i + 1) * width], offset, self.path)
            written += len(data)
        return written

    def close(self, *, sync: bool = True) -> None:
        try:
            if sync and self.durable:
                os.fsync(self.fd)
        finally:
            os.close(self.fd)

    def __enter__(self) -> "FileWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(sync=exc_type is None)


def _pwrite_all(fd: int, data: memoryview, offset: int, path: Path) -> None:
    while len(data):
        try:
            n = os.pwrite(fd, data, offset)
        except OSError as e:
            raise OSError(e.errno, f"writing {path} at byte {offset}: {e.strerror}") from e
        data, offset = data[n:], offset + n


def write_json(path: str | os.PathLike, obj: object, *, durable: bool = True) -> None:
    """Write JSON and (if `durable`) fsync it."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        if durable:
            os.fsync(f.fileno())


# ---------------------------------------------------------------------------------------------
# Reading


def read_layout(path: str | os.PathLike, fd: int | None = None) -> FileLayout:
    """Parse and check a safetensors header: errors name the file and the offending tensor.

    Accepts only what `safetensors` itself accepts (strict UTF-8 JSON, `__metadata__` a str -> str map,
    shapes and offsets lists of non-negative ints, a data section covering the rest of the file exactly),
    so a file that passes here also opens with `safe_open`. Tensor names appearing twice are refused too.
    `fd`: an open descriptor of the file (see `CheckpointFiles`); else `path` is opened.
    """
    path = Path(path)
    own = fd is None
    if own:
        fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        prefix = os.pread(fd, 8, 0)
        if len(prefix) < 8:
            raise CheckpointError(f"{path}: truncated: {size} bytes, too short for a safetensors header.")
        (n,) = struct.unpack("<Q", prefix)
        if n > _MAX_HEADER or 8 + n > size:
            raise CheckpointError(f"{path}: header length {n} does not fit in the file ({size} bytes); "
                                  "the file is truncated or not safetensors.")
        raw = os.pread(fd, n, 8)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e.strerror}).") from None
    finally:
        if own:
            os.close(fd)
    if len(raw) != n:  # the file shrank between stat() and read()
        raise CheckpointError(f"{path}: truncated while reading its {n}-byte header.")

    with _gc_paused():  # ~3 objects per tensor: the cyclic GC would rescan them all, repeatedly (+50% time)
        return _layout_of(path, prefix, raw, size)


@contextlib.contextmanager
def _gc_paused():
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _layout_of(path: Path, prefix: bytes, raw: bytes, size: int) -> FileLayout:
    n = len(raw)
    metadata, entries = parse_header(raw, path)
    if metadata is not None and not (isinstance(metadata, dict)
                                     and all(isinstance(v, str) for v in metadata.values())):
        raise CheckpointError(f"{path}: `__metadata__` must map strings to strings, got {metadata!r}.")
    start = 8 + n
    specs: dict[str, TensorSpec] = {}
    begins: dict[str, int] = {}
    # Each distinct (dtype, shape) is checked once: bytes it needs, or why it is refused.
    kinds = {kind: _kind(*kind) for kind in {(dtype, shape) for _, dtype, shape, _, _ in entries}}
    for name, dtype, shape, lo, hi in entries:  # shape entries and offsets are ints in [0, 2**64)
        torch_dtype, nbytes = kinds[dtype, shape]
        if torch_dtype is None:
            raise CheckpointError(f"{path}: tensor {name!r}: {nbytes}")
        if hi - lo != nbytes:
            raise CheckpointError(f"{path}: tensor {name!r}: data_offsets [{lo}, {hi}] hold {hi - lo} bytes, "
                                  f"but {dtype} {list(shape)} needs {nbytes}.")
        if start + hi > size:
            raise CheckpointError(f"{path}: tensor {name!r}: data ends at byte {start + hi}, past the end of the "
                                  f"file ({size} bytes); the file is truncated.")
        specs[name], begins[name] = TensorSpec(name, torch_dtype, shape), start + lo
    spans = sorted(zip((e[3] for e in entries), (e[4] for e in entries), specs))
    # Overlaps first, then gaps: a tensor moved onto another is reported with both names, not as a gap
    # left somewhere else.
    end, last = 0, None
    for lo, hi, name in spans:
        if lo < end:
            raise CheckpointError(f"{path}: tensor {name!r}: data_offsets [{lo}, {hi}] overlap tensor {last!r} "
                                  f"[{begins[last] - start}, {end}].")
        if hi > end or last is None:
            end, last = hi, name
    cursor = 0
    for lo, hi, name in spans:
        if lo != cursor:
            raise CheckpointError(f"{path}: tensor {name!r}: data_offsets [{lo}, {hi}] leave a gap of "
                                  f"{lo - cursor} bytes before it.")
        cursor = hi
    if start + cursor != size:
        raise CheckpointError(f"{path}: data section is {cursor} bytes but the file holds {size - start}; "
                              "the file is truncated or has trailing bytes.")
    return FileLayout(filename=path.name, header=prefix + raw, begins=begins, specs=specs, size=size)


def _kind(dtype: object, shape: tuple[int, ...]) -> tuple[torch.dtype | None, int | str]:
    """(torch dtype, bytes) of a tensor entry, or (None, why safetensors or we refuse it)."""
    torch_dtype = _FROM_NAME.get(dtype) if type(dtype) is str else None
    if torch_dtype is None:
        return None, f"dtype {dtype!r} is not supported (known: {', '.join(_FROM_NAME)})."
    numel = math.prod(shape)
    if numel >= LIMIT or numel == 0 and _running_product_overflows(shape):
        return None, f"shape {list(shape)} overflows 64 bits."
    if numel * torch_dtype.itemsize * 8 >= LIMIT:
        return None, f"{dtype} {list(shape)} needs more than 2**61 bytes."
    return torch_dtype, numel * torch_dtype.itemsize


def _running_product_overflows(shape: tuple[int, ...]) -> bool:
    """safetensors multiplies dims with checked u64 arithmetic, so [2**40, 2**40, 0] is refused."""
    numel = 1
    for d in shape:
        numel *= d
        if numel >= LIMIT:
            return True
    return False


def read_rows(path: str | os.PathLike, layout: FileLayout, name: str, first_row: int, stop_row: int,
              out: torch.Tensor | None = None, fd: int | None = None) -> torch.Tensor:
    """Read rows [first_row, stop_row) of `name` (rows [0, 1) of a scalar).

    With `out` (shape `(stop_row - first_row, *shape[1:])`, or `()` for a scalar) the rows land in it,
    straight from the file when it is a contiguous CPU tensor of the file's dtype, else through a temporary
    cast by `copy_`.
    """
    if name not in layout.specs:
        raise CheckpointError(f"{path}: tensor {name!r} is not in the file.")
    spec = layout.specs[name]
    rows = spec.shape[0] if spec.shape else 1
    if not (0 <= first_row <= stop_row <= rows if spec.shape else (first_row, stop_row) == (0, 1)):
        raise CheckpointError(f"{path}: tensor {name!r}: rows {first_row}:{stop_row} are outside its "
                              f"{rows} rows (shape {list(spec.shape)}).")
    shape = (stop_row - first_row, *spec.shape[1:]) if spec.shape else ()
    if out is not None and tuple(out.shape) != shape:
        raise ValueError(f"`out` has shape {list(out.shape)} but rows {first_row}:{stop_row} of {name!r} "
                         f"have shape {list(shape)}; pass a tensor of that shape.")
    if out is None or out.dtype != spec.dtype or out.device.type != "cpu" or not out.is_contiguous():
        target = torch.empty(shape, dtype=spec.dtype)
    else:
        target = out
    if target.numel():
        buf = memoryview(target.reshape(-1).view(torch.uint8).numpy()).cast("B")
        own = fd is None
        if own:
            fd = open_regular(Path(path))
        try:
            offset = layout.row_offset(name, first_row)
            got = 0
            while got < len(buf):
                more = os.preadv(fd, [buf[got:]], offset + got)
                if more == 0:
                    raise CheckpointError(f"{path}: tensor {name!r}: file ended while reading rows "
                                          f"{first_row}:{stop_row}.")
                got += more
        finally:
            if own:
                os.close(fd)
    if out is not None and target is not out:
        out.copy_(target)
        return out
    return target


def _safe_member(directory: Path, filename: object, source: Path) -> Path:
    """A file named by an index must be a plain file name inside `directory`."""
    if (not isinstance(filename, str) or not filename or filename in (".", "..") or Path(filename).name != filename
            or any(c in filename for c in "/\\\0")):
        raise CheckpointError(f"{source}: file name {filename!r} points outside {directory}; refused.")
    return directory / filename


def read_index(index_path: str | os.PathLike, dir_fd: int | None = None) -> dict[str, Path]:
    """tensor name -> file, from a `*.safetensors.index.json`; names pointing elsewhere are refused."""
    index_path = Path(index_path)
    raw = read_bounded(index_path, dir_fd)
    try:
        index = json.loads(raw.decode("utf-8"))
    except (UnicodeError, ValueError, RecursionError):  # not JSON at all: reported as not an index
        index = None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index_path}: not a safetensors index (needs a `weight_map` object).")
    return {name: _safe_member(index_path.parent, fn, index_path) for name, fn in weight_map.items()}


class CheckpointFiles:
    """Every tensor of a safetensors checkpoint (one file, or an index and its files), headers checked.

    The directory and every file are opened once, relative to the directory's descriptor, and read
    through those descriptors: a save that replaces the directory meanwhile (`atomic_dir` swaps it)
    cannot make one load read some files of the old checkpoint and some of the new. Call `close()`
    (or use `with`) when done; the descriptors are also closed when the object is collected.
    """

    def __init__(self, directory: str | os.PathLike, weights_name: str = SINGLE_FILE):
        self.directory = Path(directory)
        self._fds: dict[Path, int] = {}
        self._dir_fd = None
        for attempt in range(5):
            try:
                self._dir_fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError as e:
                raise CheckpointError(f"{self.directory}: no {weights_name} here: not a readable directory "
                                      f"({e.strerror}).") from None
            try:
                self._open(weights_name)
                return
            except BaseException:
                replaced = self._replaced_meanwhile()
                self.close()
                if not replaced or attempt == 4:
                    raise
            # A save swapped the directory and deleted the copy we had opened: open the new one.

    def _replaced_meanwhile(self) -> bool:
        try:
            return os.stat(self.directory).st_ino != os.fstat(self._dir_fd).st_ino
        except OSError:
            return False

    def _exists(self, name: str) -> bool:
        try:
            os.stat(name, dir_fd=self._dir_fd)
            return True
        except OSError:
            return False

    def _open(self, weights_name: str) -> None:
        index_path = self.directory / (weights_name + INDEX_SUFFIX)
        single = self.directory / weights_name
        if self._exists(index_path.name):
            weight_map = read_index(index_path, self._dir_fd)
        elif self._exists(single.name):
            weight_map = None
        else:
            raise CheckpointError(f"{self.directory}: no {weights_name} or {index_path.name} found.")
        files = sorted(set(weight_map.values())) if weight_map is not None else [single]
        for p in files:
            self._fds[p] = open_regular(p, self._dir_fd)
        self.layouts: dict[Path, FileLayout] = {p: read_layout(p, self._fds[p]) for p in files}
        self.where: dict[str, Path] = {}
        for path, layout in self.layouts.items():
            for name in layout.specs:
                if weight_map is not None and weight_map.get(name) != path:
                    continue  # a tensor the index assigns elsewhere (or not at all) is not part of the checkpoint
                self.where[name] = path
        if weight_map is not None:
            lost = sorted(n for n in weight_map if n not in self.where)
            if lost:
                raise CheckpointError(f"{index_path}: {len(lost)} tensor(s) listed in the index are not in their "
                                      f"file: {', '.join(lost[:10])}.")

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}
        if getattr(self, "_dir_fd", None) is not None:
            os.close(self._dir_fd)
            self._dir_fd = None

    def __enter__(self) -> "CheckpointFiles":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    def names(self) -> Iterable[str]:
        return self.where.keys()

    def spec(self, name: str) -> TensorSpec:
        return self.layouts[self.where[name]].specs[name]

    def read_rows(self, name: str, first_row: int, stop_row: int, out: torch.Tensor | None = None) -> torch.Tensor:
        path = self.where[name]
        return read_rows(path, self.layouts[path], name, first_row, stop_row, out=out, fd=self._fds[path])

    def read(self, name: str) -> torch.Tensor:
        spec = self.spec(name)
        return self.read_rows(name, 0, spec.shape[0] if spec.shape else 1).reshape(spec.shape)
