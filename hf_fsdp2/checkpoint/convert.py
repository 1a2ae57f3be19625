"""`hf-fsdp2 convert`: an Accelerate `SHARDED_STATE_DICT` checkpoint (torch DCP) -> Hugging Face safetensors.

Accelerate's `save_fsdp_model` (accelerate/utils/fsdp_utils.py) writes
`dcp.save({"model": state_dict}, storage_writer=FileSystemWriter(f"{output_dir}/pytorch_model_fsdp_{i}"))`,
so the DCP keys are the model's names behind a `model.` prefix (`model.model.layers.0...`), each tensor
stored as one chunk per rank in `__<rank>_0.distcp` files, described by a pickled `.metadata` file.

Unlike `accelerate merge-weights` (which loads the whole checkpoint into RAM and calls `save_file`), the
conversion streams: one tensor is loaded through DCP's public `dcp.load(..., no_dist=True)` and written
into a planned safetensors file (`plan_checkpoint` + `FileWriter`), then freed. Peak extra memory is about
one tensor plus one of its saved chunks (and, when casting, one write chunk of at most 16 MiB), whatever
the size of the model.

On pickle: torch's `FileSystemReader.read_metadata` reads `.metadata` with a bare `pickle.load`, which runs
any code a crafted file asks for. DCP has no other format for its global metadata, so a pickle load cannot
be avoided; we read it with an unpickler restricted to an allowlist of DCP's metadata classes (the
"Restricting Globals" recipe of the `pickle` docs) and hand the result to DCP. Tensor chunks are read by DCP
with `torch.load(weights_only=True)`. Non-tensor entries, which DCP would read with
`torch.load(weights_only=False)`, are refused before anything is read. Nothing here writes pickle.

On damaged checkpoints: `dcp.load` trusts the metadata (it allocates what it says, copies chunks that
overlap, leaves uncovered elements as they were). So before any allocation or write, every tensor's
metadata is type-checked, its chunks must tile it exactly, and every chunk's record must lie in a regular
data file and be at least the chunk's size (`check_storage`). Every such problem, and a record DCP then
fails to read, is a `CheckpointError` (a ValueError) naming the file, one line for the CLI.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import shutil
import stat
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException as DCPException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from .atomic_dir import swap_in, target_lock
from ..config import parse_dtype
from .safetensors_io import (CheckpointError, FileWriter, TensorSpec, dtype_name, open_regular, plan_checkpoint,
                             write_json)
from ..sharding import canonical_name

DCP_METADATA = ".metadata"
# Accelerate's FSDP_MODEL_NAME; the model of `model_index` i is saved under f"{ACCELERATE_MODEL_DIR}_{i}".
ACCELERATE_MODEL_DIR = "pytorch_model_fsdp"
# The top-level key Accelerate wraps the model state dict in: dcp.save(state_dict={"model": ...}).
ACCELERATE_MODEL_KEY = "model"
CONFIG_FILES = ("config.json", "generation_config.json")
INDEX_NAME = "model.safetensors.index.json"


@dataclasses.dataclass(frozen=True)
class ConvertResult:
    dst: Path
    files: tuple[str, ...]  # safetensors files written (and the index, when sharded)
    num_tensors: int
    total_bytes: int  # bytes of tensor data written
    config_source: Path | None  # where config.json came from; None when none was found


def convert_dcp_to_safetensors(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | str | None = None,
    config_dir: str | os.PathLike | None = None,
    overwrite: bool = False,
) -> ConvertResult:
    """Convert an Accelerate `SHARDED_STATE_DICT` checkpoint into a Hugging Face safetensors directory.

    Args:
        src: the DCP directory (`.../pytorch_model_fsdp_0`), or the Accelerate checkpoint directory holding
            exactly one `pytorch_model_fsdp_*` directory.
        dst: the output directory. It is built in a hidden sibling and renamed into place at the end, so a
            failure leaves no half-written `dst`. It must be absent or empty unless `overwrite`, which
            replaces it whole.
        max_shard_size: largest safetensors file ("5GB", "500MiB", bytes); above it the weights are split
            into `model-0000k-of-0000n.safetensors` plus `model.safetensors.index.json`.
        dtype: cast floating-point tensors to this dtype ("bf16", "fp16", "fp32" or a torch.dtype);
            integer tensors keep theirs. None keeps every tensor's dtype.
        config_dir: where `config.json` / `generation_config.json` come from; by default the first of
            `src`, the DCP directory and its parent that holds a `config.json`.
        overwrite: replace a non-empty `dst`.

    Runs in one process with no process group (and issues no collective when one exists).
    """
    given_src = Path(src)
    src_dir = resolve_dcp_dir(given_src)
    dtype = parse_dtype(dtype, "dtype")
    dst = _check_dst(Path(dst), src_dir, overwrite)
    config_source = _find_config_dir(config_dir, [given_src, src_dir, src_dir.parent])

    metadata = read_dcp_metadata(src_dir)
    entries = model_entries(metadata, src_dir)  # hf name -> (dcp key, tensor metadata), in saved order
    # Every size is bounded by the data files on disk before anything is allocated, read or written.
    check_storage(metadata, entries, src_dir)
    specs = [_output_spec(src_dir / DCP_METADATA, name, md, dtype) for name, (_, md) in entries.items()]
    layouts, index = plan_checkpoint(specs, max_shard_size)  # checks max_shard_size before any I/O

    dst.parent.mkdir(parents=True, exist_ok=True)
    staging = dst.parent / f".{dst.name}.convert-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        reader = _MetadataReader(src_dir, metadata)
        # Every tensor is loaded into (a view of) this one buffer: one allocation of the largest tensor
        # instead of one per tensor, which the allocator would not always hand back to the OS.
        buffer = torch.empty(max(_nbytes(md) for _, md in entries.values()), dtype=torch.uint8)
        for layout in layouts:
            with FileWriter(staging / layout.filename, layout, create=True) as writer:
                for name in layout.specs:
                    key, md = entries[name]
                    tensor = _load_tensor(reader, key, md, buffer)
                    writer.write_rows(name, 0, tensor)  # casts to the planned dtype in small chunks
        files = [layout.filename for layout in layouts]
        if index is not None:
            write_json(staging / INDEX_NAME, index)
            files.append(INDEX_NAME)
        if config_source is not None:
            _copy_configs(config_source, staging, dtype)
        with target_lock(dst):  # the same commit as save_pretrained's, replacing everything in dst
            swap_in(staging, dst, replaced=lambda name: True, durable=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return ConvertResult(dst=dst, files=tuple(files), num_tensors=len(specs),
                         total_bytes=sum(s.nbytes for s in specs), config_source=config_source)


# ---------------------------------------------------------------------------------------------
# Reading the DCP checkpoint


def resolve_dcp_dir(src: Path) -> Path:
    """`src` itself when it holds a DCP `.metadata`, else its only `pytorch_model_fsdp_*` child that does.

    `.metadata` is looked for with lexists, not is_file: a FIFO or directory in its place is then refused
    by `read_dcp_metadata` with its own name, and nothing here opens it (opening a FIFO blocks)."""
    if not src.exists():
        raise ValueError(f"`src`={src}: no such file or directory.")
    if not src.is_dir():
        raise ValueError(f"`src`={src} is a file; pass the DCP directory Accelerate wrote "
                         f"(`{ACCELERATE_MODEL_DIR}_0`, holding `{DCP_METADATA}` and `*.distcp` files).")
    if os.path.lexists(src / DCP_METADATA):
        return src
    children = sorted(p for p in src.glob(f"{ACCELERATE_MODEL_DIR}_*") if os.path.lexists(p / DCP_METADATA))
    if len(children) == 1:
        return children[0]
    if children:
        raise ValueError(f"`src`={src} holds several model checkpoints ({', '.join(p.name for p in children)}); "
                         "pass the one to convert.")
    raise ValueError(f"`src`={src} is not a torch.distributed.checkpoint directory: it has no `{DCP_METADATA}` "
                     f"file and no `{ACCELERATE_MODEL_DIR}_*` directory with one. Pass the `{ACCELERATE_MODEL_DIR}_0` "
                     "directory of a checkpoint saved with `fsdp_state_dict_type: SHARDED_STATE_DICT`.")


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's `.metadata` but refuses every global outside DCP's own metadata classes."""

    _ALLOWED = {
        *(("torch.distributed.checkpoint.metadata", n) for n in (
            "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
            "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # layout by name ("torch.strided"), a dict lookup
        ("collections", "OrderedDict"),
        # StorageMeta.checkpoint_id is the path the checkpoint was saved to.
        *((m, n) for m in ("pathlib", "pathlib._local")
          for n in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global `{module}.{name}` is not part of DCP's metadata; refused")


def read_dcp_metadata(src_dir: Path) -> Metadata:
    """DCP's `.metadata`, read with the restricted unpickler; its fields are checked to have DCP's types.

    Raises `CheckpointError` naming the file when it is missing, not a regular file, or malformed."""
    path = src_dir / DCP_METADATA
    fd = open_regular(path)  # O_NONBLOCK + S_ISREG: a FIFO is refused instead of blocking the open
    try:
        with os.fdopen(fd, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except Exception as e:  # only allowlisted constructors ran, so any error means a damaged file
        raise CheckpointError(f"{path}: not a readable torch.distributed.checkpoint metadata file "
                              f"({_describe_error(e)}).") from None
    _check_metadata_fields(path, metadata)
    return metadata


def _check_metadata_fields(path: Path, metadata: object) -> None:
    """The top-level fields of DCP's `Metadata` (torch/distributed/checkpoint/metadata.py) that we and
    `dcp.load` use have the types DCP writes; the per-tensor fields are checked by `model_entries`."""
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path}: not torch.distributed.checkpoint metadata (it holds a "
                              f"{type(metadata).__name__}, not a Metadata).")
    # A pickle can omit a dataclass field (it restores __dict__ as saved), hence getattr.
    for field, types in (("state_dict_metadata", dict), ("storage_data", dict), ("planner_data", (dict, type(None)))):
        value = getattr(metadata, field, None)
        if not isinstance(value, types):
            found = "missing" if value is None else f"a {type(value).__name__}"
            raise CheckpointError(f"{path}: damaged metadata: `{field}` is {found}, expected a dict.")
    bad = next((k for k in metadata.state_dict_metadata if not isinstance(k, str)), None)
    if bad is not None:
        raise CheckpointError(f"{path}: damaged metadata: state dict key {bad!r:.100} is not a string.")


def model_entries(metadata: Metadata, src_dir: Path) -> dict[str, tuple[str, TensorStorageMetadata]]:
    """Hugging Face name -> (DCP key, tensor metadata) for every tensor of the model state dict.

    DCP flattens nested state dicts and records each key's path in `planner_data`
    (e.g. "model.lm_head.weight" -> ("model", "lm_head.weight")), so Accelerate's `model` wrapper is removed
    exactly, not by guessing at a "model." prefix that Llama's own names also start with.
    Each tensor's metadata and chunk layout are checked (`_check_tensor_metadata`).
    """
    where = src_dir / DCP_METADATA
    paths = {key: _planner_path(where, metadata.planner_data, key) for key in metadata.state_dict_metadata}
    wrapped = {k: p for k, p in paths.items() if len(p) >= 2 and p[0] == ACCELERATE_MODEL_KEY}
    if wrapped:  # Accelerate's layout; anything beside "model" (another state dict) is not ours to convert
        names = {k: ".".join(str(part) for part in p[1:]) for k, p in wrapped.items()}
    elif all(len(p) == 1 for p in paths.values()):  # a bare model state dict saved with dcp.save
        names = {k: k for k in paths}
    else:
        tops = sorted({str(p[0]) for p in paths.values()})
        hint = (" This looks like an optimizer checkpoint; pass the model's `pytorch_model_fsdp_0` directory."
                if "optimizer" in tops else "")
        raise CheckpointError(f"{where}: no model state dict: the checkpoint's top-level entries are {tops}, "
                              f"expected `{ACCELERATE_MODEL_KEY}` (Accelerate's layout).{hint}")
    if not names:
        raise CheckpointError(f"{where}: the checkpoint holds no tensors.")
    non_tensor = [k for k in names if not isinstance(metadata.state_dict_metadata[k], TensorStorageMetadata)]
    if non_tensor:
        raise CheckpointError(f"{where}: {len(non_tensor)} entr{'y is' if len(non_tensor) == 1 else 'ies are'} not "
                              f"tensors ({', '.join(non_tensor[:5])}); a safetensors file holds only tensors. "
                              "Convert a model state dict (Accelerate's `pytorch_model_fsdp_*` directory).")
    out: dict[str, tuple[str, TensorStorageMetadata]] = {}
    for key, name in names.items():
        name = canonical_name(name)
        if name.startswith("base_model.model."):
            raise CheckpointError(f"{where}: `{name}` is a PEFT model's name; converting a PEFT checkpoint is not "
                                  "supported (merge the adapter, or save it with PEFT's `save_pretrained`).")
        if name in out:
            raise CheckpointError(f"{where}: DCP keys {out[name][0]!r} and {key!r} both map to `{name}`.")
        md = metadata.state_dict_metadata[key]
        _check_tensor_metadata(where, key, md)
        _check_chunks(where, key, md)
        out[name] = (key, md)
    return out


def _planner_path(where: Path, planner_data: dict | None, key: str) -> tuple:
    """The nested path DCP recorded for `key` (a tuple of str/int, DCP's OBJ_PATH), or `(key,)`."""
    path = (planner_data or {}).get(key) or (key,)
    if not isinstance(path, (tuple, list)) or not all(isinstance(p, (str, int)) for p in path):
        raise CheckpointError(f"{where}: damaged metadata: planner_data for {key!r} is {path!r:.100}, "
                              "not a path of names.")
    return tuple(path)


def _is_shape(value: object) -> bool:
    """A torch.Size (or tuple) of non-negative ints: DCP's `size`, `offsets` and `sizes` fields."""
    return isinstance(value, tuple) and all(type(d) is int and d >= 0 for d in value)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _check_tensor_metadata(where: Path, key: str, md: TensorStorageMetadata) -> None:
    """`md` has the fields and types of DCP's TensorStorageMetadata (metadata.py), chunks included."""
    properties, size, chunks = (getattr(md, f, None) for f in ("properties", "size", "chunks"))
    if not isinstance(getattr(properties, "dtype", None), torch.dtype):
        raise CheckpointError(f"{where}: damaged metadata: tensor {key!r} has no dtype.")
    if not _is_shape(size):
        raise CheckpointError(f"{where}: damaged metadata: tensor {key!r} has shape {size!r:.100}, not a tuple "
                              "of non-negative integers.")
    if not isinstance(chunks, list) or not chunks:
        raise CheckpointError(f"{where}: damaged metadata: tensor {key!r} lists no saved chunks.")
    for chunk in chunks:
        offsets, sizes = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
        if not (_is_shape(offsets) and _is_shape(sizes) and len(offsets) == len(sizes) == len(size)):
            raise CheckpointError(f"{where}: damaged metadata: tensor {key!r} of shape {list(size)} has a chunk "
                                  f"with offsets {offsets!r:.100} and sizes {sizes!r:.100}.")


def _check_chunks(where: Path, key: str, md: TensorStorageMetadata) -> None:
    """The saved chunks must tile the tensor exactly. `dcp.load` copies every chunk that intersects the
    target, in file order, and never checks the tiling: overlapping chunks silently overwrite each other
    and uncovered elements are left as they were (here: bytes of the previous tensor)."""
    for chunk in md.chunks:
        if any(o + s > d for o, s, d in zip(chunk.offsets, chunk.sizes, md.size)):
            raise CheckpointError(f"{where}: tensor {key!r} of shape {list(md.size)}: its chunk at offsets "
                                  f"{list(chunk.offsets)} with sizes {list(chunk.sizes)} lies outside the tensor.")
    overlap = _first_overlap(md.chunks)
    if overlap is not None:
        a, b = overlap
        raise CheckpointError(f"{where}: tensor {key!r} of shape {list(md.size)}: its chunks at offsets "
                              f"{list(a.offsets)} and {list(b.offsets)} overlap.")
    # Inside the tensor and disjoint: they cover it exactly iff their element counts add up.
    covered, numel = sum(_numel(c.sizes) for c in md.chunks), _numel(md.size)
    if covered != numel:
        raise CheckpointError(f"{where}: tensor {key!r} of shape {list(md.size)}: its saved chunks hold {covered} "
                              f"of {numel} elements; the checkpoint is incomplete.")


def _first_overlap(chunks: list) -> tuple[Any, Any] | None:
    """Two non-empty chunks sharing an element, or None. A sweep along dim 0: a chunk is compared only
    with those whose dim-0 range is still open, which for FSDP's row slabs is none, so it stays linear
    in the number of ranks. A 0-d tensor's chunks all span the one element."""
    def dim0(c: Any) -> tuple[int, int]:
        return (c.offsets[0], c.offsets[0] + c.sizes[0]) if c.offsets else (0, 1)

    active: list = []
    for chunk in sorted((c for c in chunks if _numel(c.sizes)), key=lambda c: tuple(c.offsets)):
        start = dim0(chunk)[0]
        active = [a for a in active if dim0(a)[1] > start]
        for a in active:
            if all(ao < co + cs and co < ao + as_ for ao, as_, co, cs in
                   zip(a.offsets, a.sizes, chunk.offsets, chunk.sizes)):
                return a, chunk
        active.append(chunk)
    return None


def check_storage(metadata: Metadata, entries: dict[str, tuple[str, TensorStorageMetadata]], src_dir: Path) -> None:
    """Check that every chunk's bytes are on disk before anything is allocated or read.

    DCP's FileSystemWriter (torch/distributed/checkpoint/filesystem.py) records each chunk in
    `storage_data[MetadataIndex(fqn, chunk.offsets)]` as a `_StorageInfo(relative_path, offset, length)`:
    a `torch.save` record, which is uncompressed and holds the chunk's whole storage (the writer clones
    views first), so it is at least the chunk's byte size. Records must lie inside their file and not
    share bytes, so the tensors a checkpoint claims can never add up to more than its data files hold.
    """
    where = src_dir / DCP_METADATA
    file_sizes: dict[str, int] = {}
    spans: dict[str, dict[MetadataIndex, tuple[int, int]]] = {}  # data file -> record -> byte range
    for key, md in entries.values():
        itemsize = md.properties.dtype.itemsize
        for chunk in md.chunks:
            index = MetadataIndex(key, chunk.offsets)
            info = _storage_info(where, metadata.storage_data, index)
            rel = info.relative_path
            if rel not in file_sizes:
                file_sizes[rel] = _data_file_size(src_dir / rel)
            if info.offset + info.length > file_sizes[rel]:
                raise CheckpointError(f"{src_dir / rel}: truncated: {file_sizes[rel]} bytes, but the chunk of "
                                      f"{key!r} at offsets {list(chunk.offsets)} is recorded at bytes "
                                      f"{info.offset}-{info.offset + info.length}.")
            nbytes = _numel(chunk.sizes) * itemsize
            if nbytes > info.length:
                raise CheckpointError(f"{src_dir / rel}: the chunk of {key!r} at offsets {list(chunk.offsets)} "
                                      f"needs {nbytes} bytes, but its record is {info.length} bytes; the "
                                      "metadata does not match the data.")
            spans.setdefault(rel, {})[index] = (info.offset, info.offset + info.length)
    for rel, ranges in spans.items():
        _check_disjoint(src_dir / rel, ranges)


def _storage_info(where: Path, storage_data: dict, index: MetadataIndex) -> _StorageInfo:
    """The `_StorageInfo` of one chunk, checked to name a plain file of the checkpoint directory."""
    info = storage_data.get(index)
    at = f"the chunk of {index.fqn!r} at offsets {list(index.offset)}"
    if info is None:
        raise CheckpointError(f"{where}: damaged metadata: {at} has no storage entry.")
    rel, offset, length = (getattr(info, f, None) for f in ("relative_path", "offset", "length"))
    if not isinstance(info, _StorageInfo) or not isinstance(rel, str) or not all(
            type(v) is int and v >= 0 for v in (offset, length)):
        raise CheckpointError(f"{where}: damaged metadata: the storage entry of {at} is {info!r:.200}.")
    if Path(rel).name != rel or rel in ("", ".", "..") or "\0" in rel:
        raise CheckpointError(f"{where}: data file name {rel!r} points outside {where.parent}; refused.")
    if getattr(info, "transform_descriptors", None):  # e.g. DCP's zstd extension: the sizes above would not hold
        raise CheckpointError(f"{where}: {at} is stored through DCP extensions {info.transform_descriptors!r:.100}, "
                              "which this converter does not read.")
    return info


def _data_file_size(path: Path) -> int:
    """Size of a data file, which must be a regular file (stat does not open it, so a FIFO cannot block)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: data file is missing; the checkpoint is incomplete.") from None
    except OSError as e:
        raise CheckpointError(f"{path}: data file cannot be read ({e.strerror}).") from None
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{path}: data file is not a regular file (a directory, FIFO or device); refused.")
    return st.st_size


def _check_disjoint(path: Path, ranges: dict[MetadataIndex, tuple[int, int]]) -> None:
    """DCP writes each record once, one after another: two records sharing bytes is a forged layout."""
    end, previous = 0, None
    for index, (begin, stop) in sorted(ranges.items(), key=lambda item: item[1]):
        if begin == stop:
            continue
        if begin < end:
            raise CheckpointError(f"{path}: the records of {previous.fqn!r} and {index.fqn!r} overlap "
                                  f"(bytes {begin}-{min(end, stop)}); the metadata does not match the data.")
        end, previous = stop, index


def _output_spec(where: Path, name: str, md: TensorStorageMetadata, dtype: torch.dtype | None) -> TensorSpec:
    stored = md.properties.dtype
    target = dtype if dtype is not None and stored.is_floating_point else stored
    try:
        dtype_name(target)
    except TypeError as e:
        raise CheckpointError(f"{where}: tensor `{name}`: {e}") from None
    return TensorSpec(name, target, tuple(md.size))


class _MetadataReader(FileSystemReader):
    """A `FileSystemReader` that serves the metadata we already read (restricted, once) instead of
    re-unpickling `.metadata` with a bare `pickle.load` on every `dcp.load` call."""

    def __init__(self, path: Path, metadata: Metadata):
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._metadata


def _nbytes(md: TensorStorageMetadata) -> int:
    return _numel(md.size) * md.properties.dtype.itemsize


def _load_tensor(reader: _MetadataReader, key: str, md: TensorStorageMetadata, buffer: torch.Tensor) -> torch.Tensor:
    """One whole tensor, in its saved dtype, assembled by DCP from every rank's chunk into `buffer`.

    The layout was checked beforehand (`check_storage`); what can still fail is a record whose bytes are
    not a torch.save of its chunk. DCP reports that as a CheckpointException (a BaseException) wrapping
    the cause, with no file name, so the failing record is then found by reading each one."""
    target = buffer[:_nbytes(md)].view(md.properties.dtype).view(tuple(md.size))
    try:
        with warnings.catch_warnings():
            # dcp.load warns on every call that no process group is used: that is the point here.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({key: target}, storage_reader=reader, planner=DefaultLoadPlanner(), no_dist=True)
    except (Exception, DCPException) as e:
        cause = _unwrap(e)
    else:
        return target
    if not isinstance(cause, Exception):  # Ctrl-C inside dcp.load comes back wrapped
        raise cause
    storage = reader.read_metadata().storage_data
    _check_records(Path(reader.path), storage, key, md)  # raises naming the file of a damaged record
    files = sorted({storage[MetadataIndex(key, c.offsets)].relative_path for c in md.chunks})
    raise CheckpointError(f"{reader.path} ({', '.join(files)}): tensor {key!r} cannot be read: "
                          f"{_describe_error(cause)}")


def _unwrap(e: BaseException) -> BaseException:
    """The first underlying exception of DCP's CheckpointException (its str() is multi-line tracebacks)."""
    if isinstance(e, DCPException) and e.failures:
        return next(iter(e.failures.values()))[0]
    return e


def _check_records(src_dir: Path, storage_data: dict, key: str, md: TensorStorageMetadata) -> None:
    """Raise naming the first data file whose record of a chunk of `key` is not a tensor of the chunk's
    shape, read as DCP reads it (`torch.load(weights_only=True)`, filesystem.py `read_data`), one chunk
    at a time. Runs only after a failed load."""
    for chunk in md.chunks:
        info = storage_data[MetadataIndex(key, chunk.offsets)]
        path = src_dir / info.relative_path
        fd = open_regular(path)
        try:
            raw = os.pread(fd, info.length, info.offset)
        finally:
            os.close(fd)
        try:
            tensor = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
            problem = None if isinstance(tensor, torch.Tensor) and tensor.shape == chunk.sizes else (
                f"it holds {type(tensor).__name__} {list(getattr(tensor, 'shape', []))}")
        except Exception as e:  # any failure to parse the record is the damage being reported
            problem = _describe_error(e)
        if problem is not None:
            raise CheckpointError(f"{path}: bytes {info.offset}-{info.offset + info.length} (the chunk of {key!r} "
                                  f"at offsets {list(chunk.offsets)}) are not a saved tensor of shape "
                                  f"{list(chunk.sizes)}: {problem}.")


def _describe_error(e: BaseException, limit: int = 300) -> str:
    """`Type: message` on one line, cut to `limit` characters: the CLI prints errors as a single line.

    torch.load's weights-only failures open with advice to retry with `weights_only=False`, which would
    run the file's code: only their actual reason is kept."""
    text = " ".join(str(e).split())
    reason = text.partition("WeightsUnpickler error: ")[2]
    if reason:
        text = "weights-only unpickler: " + reason.partition(" Check the documentation of torch.load")[0]
    text = f"{type(e).__name__}: {text}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


# ---------------------------------------------------------------------------------------------
# The output directory


def _check_dst(dst: Path, src_dir: Path, overwrite: bool) -> Path:
    dst = dst.absolute()
    if dst.exists() and not dst.is_dir():
        raise ValueError(f"`dst`={dst} is a file; pass a directory.")
    if src_dir.resolve() == dst.resolve() or dst.resolve() in src_dir.resolve().parents:
        raise ValueError(f"`dst`={dst} is or contains the source checkpoint {src_dir}; choose another directory.")
    if dst.is_dir() and any(dst.iterdir()) and not overwrite:
        raise ValueError(f"`dst`={dst} exists and is not empty; pass --overwrite (overwrite=True) to replace it.")
    return dst


def _find_config_dir(config_dir: str | os.PathLike | None, candidates: list[Path]) -> Path | None:
    if config_dir is not None:
        config_dir = Path(config_dir)
        if not (config_dir / "config.json").is_file():
            raise ValueError(f"`config_dir`={config_dir} has no config.json; pass the directory of the model's "
                             "config (e.g. the original Hugging Face model directory).")
        return config_dir
    for d in dict.fromkeys(candidates):
        if (d / "config.json").is_file():
            return d
    return None


def _copy_configs(source: Path, staging: Path, dtype: torch.dtype | None) -> None:
    for name in CONFIG_FILES:
        if not (source / name).is_file():
            continue
        if name == "config.json" and dtype is not None:
            # The weights are now `dtype`: say so, or `from_pretrained(dtype="auto")` loads them as the old one.
            config = json.loads((source / name).read_text(encoding="utf-8"))
            for field in [f for f in ("dtype", "torch_dtype") if f in config] or ["dtype"]:
                config[field] = str(dtype).removeprefix("torch.")
            write_json(staging / name, config)
        else:
            shutil.copyfile(source / name, staging / name)
