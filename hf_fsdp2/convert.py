"""`hf-fsdp2 convert`: an Accelerate `SHARDED_STATE_DICT` checkpoint (torch DCP) -> Hugging Face safetensors.

Accelerate's `save_fsdp_model` (accelerate/utils/fsdp_utils.py) writes
`dcp.save({"model": state_dict}, storage_writer=FileSystemWriter(f"{output_dir}/pytorch_model_fsdp_{i}"))`,
so the DCP keys are the model's names behind a `model.` prefix (`model.model.layers.0...`), each tensor
stored as one chunk per rank in `__<rank>_0.distcp` files, described by a pickled `.metadata` file.

Unlike `accelerate merge-weights` (which loads the whole checkpoint into RAM and calls `save_file`), the
conversion streams: one tensor is loaded through DCP's public `dcp.load(..., no_dist=True)` and written
into a planned safetensors file (`plan_checkpoint` + `FileWriter`), then freed. Peak extra memory is about
one tensor plus one of its saved chunks, whatever the size of the model.

On pickle: torch's `FileSystemReader.read_metadata` reads `.metadata` with a bare `pickle.load`, which runs
any code a crafted file asks for. DCP has no other format for its global metadata, so a pickle load cannot
be avoided; we read it with an unpickler restricted to an allowlist of DCP's metadata classes (the
"Restricting Globals" recipe of the `pickle` docs) and hand the result to DCP. Tensor chunks are read by DCP
with `torch.load(weights_only=True)`. Non-tensor entries, which DCP would read with
`torch.load(weights_only=False)`, are refused before anything is read. Nothing here writes pickle.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from .atomic_dir import fsync_dir
from .config import parse_dtype
from .safetensors_io import FileWriter, TensorSpec, dtype_name, plan_checkpoint, write_json
from .sharding import canonical_name

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
    specs = [_output_spec(name, md, dtype) for name, (_, md) in entries.items()]
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
        fsync_dir(staging)
        _commit(staging, dst)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return ConvertResult(dst=dst, files=tuple(files), num_tensors=len(specs),
                         total_bytes=sum(s.nbytes for s in specs), config_source=config_source)


# ---------------------------------------------------------------------------------------------
# Reading the DCP checkpoint


def resolve_dcp_dir(src: Path) -> Path:
    """`src` itself when it holds a DCP `.metadata`, else its only `pytorch_model_fsdp_*` child that does."""
    if not src.exists():
        raise ValueError(f"`src`={src}: no such file or directory.")
    if not src.is_dir():
        raise ValueError(f"`src`={src} is a file; pass the DCP directory Accelerate wrote "
                         f"(`{ACCELERATE_MODEL_DIR}_0`, holding `{DCP_METADATA}` and `*.distcp` files).")
    if (src / DCP_METADATA).is_file():
        return src
    children = sorted(p for p in src.glob(f"{ACCELERATE_MODEL_DIR}_*") if (p / DCP_METADATA).is_file())
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
    """DCP's `.metadata`, read with the restricted unpickler and checked to point only inside `src_dir`."""
    path = src_dir / DCP_METADATA
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, IndexError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: not a readable torch.distributed.checkpoint metadata file ({e}).") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise ValueError(f"{path}: not torch.distributed.checkpoint metadata (found {type(metadata).__name__}).")
    storage = metadata.storage_data if isinstance(metadata.storage_data, dict) else {}
    for info in storage.values():
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or Path(rel).name != rel or rel in ("", ".", ".."):
            raise ValueError(f"{path}: data file name {rel!r} points outside {src_dir}; refused.")
        if not (src_dir / rel).is_file():
            raise ValueError(f"{path}: data file {src_dir / rel} is missing; the checkpoint is incomplete.")
    return metadata


def model_entries(metadata: Metadata, src_dir: Path) -> dict[str, tuple[str, TensorStorageMetadata]]:
    """Hugging Face name -> (DCP key, tensor metadata) for every tensor of the model state dict.

    DCP flattens nested state dicts and records each key's path in `planner_data`
    (e.g. "model.lm_head.weight" -> ("model", "lm_head.weight")), so Accelerate's `model` wrapper is removed
    exactly, not by guessing at a "model." prefix that Llama's own names also start with.
    """
    where = src_dir / DCP_METADATA
    planner_data = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    paths = {key: tuple(planner_data.get(key) or (key,)) for key in metadata.state_dict_metadata}
    wrapped = {k: p for k, p in paths.items() if len(p) >= 2 and p[0] == ACCELERATE_MODEL_KEY}
    if wrapped:  # Accelerate's layout; anything beside "model" (another state dict) is not ours to convert
        names = {k: ".".join(str(part) for part in p[1:]) for k, p in wrapped.items()}
    elif all(len(p) == 1 for p in paths.values()):  # a bare model state dict saved with dcp.save
        names = {k: k for k in paths}
    else:
        tops = sorted({str(p[0]) for p in paths.values()})
        hint = (" This looks like an optimizer checkpoint; pass the model's `pytorch_model_fsdp_0` directory."
                if "optimizer" in tops else "")
        raise ValueError(f"{where}: no model state dict: the checkpoint's top-level entries are {tops}, "
                         f"expected `{ACCELERATE_MODEL_KEY}` (Accelerate's layout).{hint}")
    if not names:
        raise ValueError(f"{where}: the checkpoint holds no tensors.")
    non_tensor = [k for k in names if not isinstance(metadata.state_dict_metadata[k], TensorStorageMetadata)]
    if non_tensor:
        raise ValueError(f"{where}: {len(non_tensor)} entr{'y is' if len(non_tensor) == 1 else 'ies are'} not "
                         f"tensors ({', '.join(non_tensor[:5])}); a safetensors file holds only tensors. "
                         "Convert a model state dict (Accelerate's `pytorch_model_fsdp_*` directory).")
    out: dict[str, tuple[str, TensorStorageMetadata]] = {}
    for key, name in names.items():
        name = canonical_name(name)
        if name.startswith("base_model.model."):
            raise ValueError(f"{where}: `{name}` is a PEFT model's name; converting a PEFT checkpoint is not "
                             "supported (merge the adapter, or save it with PEFT's `save_pretrained`).")
        if name in out:
            raise ValueError(f"{where}: DCP keys {out[name][0]!r} and {key!r} both map to `{name}`.")
        md = metadata.state_dict_metadata[key]
        _check_chunks(where, key, md)
        out[name] = (key, md)
    return out


def _check_chunks(where: Path, key: str, md: TensorStorageMetadata) -> None:
    """The saved chunks must cover the tensor, or `dcp.load` leaves part of it uninitialised."""
    numel = 1
    for d in md.size:
        numel *= d
    covered = 0
    for chunk in md.chunks:
        n = 1
        for d in chunk.sizes:
            n *= d
        covered += n
    if covered != numel:
        raise ValueError(f"{where}: tensor {key!r} of shape {list(md.size)}: its saved chunks hold {covered} of "
                         f"{numel} elements; the checkpoint is incomplete.")


def _output_spec(name: str, md: TensorStorageMetadata, dtype: torch.dtype | None) -> TensorSpec:
    stored = md.properties.dtype
    target = dtype if dtype is not None and stored.is_floating_point else stored
    try:
        dtype_name(target)
    except TypeError as e:
        raise ValueError(f"tensor `{name}`: {e}") from None
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
    return md.size.numel() * md.properties.dtype.itemsize


def _load_tensor(reader: _MetadataReader, key: str, md: TensorStorageMetadata, buffer: torch.Tensor) -> torch.Tensor:
    """One whole tensor, in its saved dtype, assembled by DCP from every rank's chunk into `buffer`."""
    target = buffer[:_nbytes(md)].view(md.properties.dtype).view(tuple(md.size))
    with warnings.catch_warnings():
        # dcp.load warns on every call that no process group is used: that is the point here.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({key: target}, storage_reader=reader, planner=DefaultLoadPlanner(), no_dist=True)
    return target


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


def _commit(staging: Path, dst: Path) -> None:
    """Rename the finished staging directory to `dst`; an existing `dst` is moved aside first and
    deleted only once the new one is in place."""
    if dst.is_dir() and any(dst.iterdir()):
        old = dst.parent / f".{dst.name}.replaced-{uuid.uuid4().hex[:8]}"
        os.rename(dst, old)
        try:
            os.rename(staging, dst)
        except BaseException:
            os.rename(old, dst)
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        if dst.is_dir():
            dst.rmdir()
        os.rename(staging, dst)
    fsync_dir(dst.parent)
