"""The weights I/O that `save_pretrained`, `load_pretrained` and the training state share: writing
each rank's rows of the export plan's tensors (export_plan.py) into safetensors files
(`write_tensors`), and checking then reading each rank's rows back (`match_tensors`, `read_tensors`,
`WeightsPlan`). No collectives except the agreement inside a commit.
"""

from __future__ import annotations

import contextlib
import copy
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Sequence

import torch
import torch.nn as nn
from tqdm.auto import tqdm

from .key_conversion import DiskView, disk_views, original_class
from ..runtime import collectives
from ..runtime.distributed import local_tensor
from .safetensors_io import (
    INDEX_SUFFIX, SINGLE_FILE, CheckpointError, CheckpointFiles, FileWriter, plan_checkpoint, write_json,
)
from ..quantization import quantized
from .lora_merge import base_model_name
from ..sharding import engine
from ..sharding.model_parts import ModelParts, SavedAdapter
from .tensor_export import (
    ExportTensor, adapter_tensors, block_range, model_tensors, row_range, tied_aliases,
)

ADAPTER_FILE = "adapter_model.safetensors"
PROGRESS_MIN_BYTES = 1 << 30  # progress bars for checkpoints of 1 GiB and more


def _progress(total: int, desc: str, enabled: bool | None):
    show = (total >= PROGRESS_MIN_BYTES) if enabled is None else enabled
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=not show or collectives.rank() != 0)


# ---------------------------------------------------------------------------------------------
# Writing


def transformers_max_shard_size() -> int | str:
    """The installed transformers' default `max_shard_size` ("5GB" in 4.x, "50GB" in 5.x), so our
    files split exactly where stock `save_pretrained` splits them."""
    import inspect

    from transformers import PreTrainedModel

    return inspect.signature(PreTrainedModel.save_pretrained).parameters["max_shard_size"].default


def write_tensors(items: Sequence[ExportTensor], directory: Path, *, weights_name: str = SINGLE_FILE,
                  max_shard_size: int | str = "5GB", progress: bool | None = None, durable: bool = True,
                  total_parameters: int | None = None) -> None:
    """Write `items` as safetensors file(s) in `directory`: each rank writes its own rows.

    Headers are planned identically on every rank, so no rank waits for another; the caller commits.
    No collectives (`merged_tensors` gathers the LoRA factors before).
    """
    layouts, index = plan_checkpoint([item.spec for item in items], max_shard_size, weights_name)
    by_name = {item.name: item for item in items}
    work = []  # (layout, name, first row, stop row) this rank writes
    for layout in layouts:
        for name in layout.specs:
            start, stop = by_name[name].rows()
            work.append((layout, name, start, stop))
    # The bar shows rank 0's share, which is about 1/N of the checkpoint.
    total = sum(layout.specs[name].row_bytes * (stop - start) for layout, name, start, stop in work)
    # no_grad: writing reads parameters; autograd bookkeeping (views of leaves that require grad) is
    # useless here and takes per-tensor locks other threads may hold.
    # Rows computed at write time (a merged adapter, dequantized 4-bit) overlap with the writes on a thread of
    # their own; rows read as they are (a plain model, staged rows of a background save, which may run at
    # interpreter exit, when no thread can be started) are written here.
    computed = any(getattr(item, "local_rows", None) is not None for item in items)
    with _progress(total, f"saving {directory.name} (rank 0 share)", progress) as bar, torch.no_grad(), \
            (ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf_fsdp2-write") if computed
             else contextlib.nullcontext()) as io:
        for layout in layouts:
            with FileWriter(directory / layout.filename, layout, create=collectives.rank() == 0, durable=durable) as writer:
                blocks = ((name, start, by_name[name]) for lay, name, start, stop in work
                          if lay is layout and stop > start)
                if io is None:
                    for name, start, item in blocks:
                        bar.update(writer.write_block(name, start, item.cols(), item.block()))
                else:
                    _write_overlapped(writer, blocks, io, bar)
    if index is not None and collectives.rank() == 0:
        if total_parameters is not None:  # stock save_pretrained: {"total_parameters", "total_size"}
            index["metadata"] = {"total_parameters": total_parameters, **index["metadata"]}
        write_json(directory / (weights_name + INDEX_SUFFIX), index, durable=durable)


def _write_overlapped(writer: FileWriter, blocks, io: ThreadPoolExecutor, bar) -> None:
    """Each item's rows computed here, piece by piece (`ExportTensor.pieces`), while the previous piece is
    written on `io`'s thread: a merged LoRA block (base rows + B @ A, checkpoint/export_plan.py) or a
    dequantized 4-bit one costs CPU time that would otherwise add to the disk's; pwrite and torch's kernels
    release the GIL. A piece is written before the next-but-one is computed (the merge reuses two buffers);
    every write has ended before the file is closed."""
    pending = None
    try:
        for name, start, item in blocks:
            for offset, piece in item.pieces():
                args = (name, start + offset, item.cols(), piece)
                if pending is not None:
                    bar.update(pending.result())
                pending = io.submit(writer.write_block, *args)
        if pending is not None:
            bar.update(pending.result())
            pending = None
    finally:
        if pending is not None:  # an error while computing: the write in flight ends before the file closes
            wait([pending])


def write_configs(parts: ModelParts, directory: Path, adapter: SavedAdapter | None,
                  dtype: torch.dtype | None) -> None:
    """config.json / generation_config.json, or adapter_config.json when an adapter is saved (`adapter`: read from
    the parts where the save came in) (rank 0 only)."""
    if adapter is not None:
        _write_adapter_config(parts, adapter, directory)
        return
    base = parts.base
    config = getattr(base, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        # As stock save_pretrained sets them (modeling_utils.PreTrainedModel.save_pretrained): the class
        # (FSDP2's "FSDP<Class>" or replicate's "DDP<Class>" removed) and the dtype of the weights on disk.
        config = copy.deepcopy(config)
        if getattr(config, "quantization_config", None) is not None:  # 4-bit weights are written dequantized
            del config.quantization_config
        config.architectures = [(original_class(type(base)) or type(base)).__name__]
        saved = dtype if dtype is not None else next(
            (p.dtype for p in base.parameters() if p.is_floating_point()), None)
        if saved is not None:
            config.dtype = str(saved).removeprefix("torch.")
        config.save_pretrained(str(directory))
    generation = getattr(base, "generation_config", None)
    if generation is not None and hasattr(base, "can_generate") and base.can_generate():
        generation.save_pretrained(str(directory))


def _write_adapter_config(parts: ModelParts, adapter: SavedAdapter, directory: Path) -> None:
    """adapter_config.json exactly as `PeftModel.save_pretrained` writes it (peft_model.py): the base
    model's name, `inference_mode=True`, and `auto_mapping` when no task type is set."""
    config = adapter.config  # the save's own copy (ModelParts.saved_adapter)
    if config.base_model_name_or_path is None:
        config.base_model_name_or_path = parts.base.__dict__.get("name_or_path", None) or None
    config.inference_mode = True
    auto_mapping = None
    if adapter.base_class is not None:  # no task type
        base_class = adapter.base_class
        auto_mapping = {"base_model_class": base_class.__name__, "parent_library": base_class.__module__}
    config.save_pretrained(str(directory), auto_mapping_dict=auto_mapping)


# ---------------------------------------------------------------------------------------------
# Reading


def match_tensors(targets: dict[str, torch.Tensor], files: CheckpointFiles, *, aliases: dict[str, str] | None = None,
                  strict: bool = True) -> dict[str, str]:
    """{target name: checkpoint name} after checking every key, shape and dtype; changes nothing.

    Missing, unexpected and mismatched keys are collected and reported in one error.
    """
    aliases = aliases or {}
    source_of = {}
    for name in targets:
        if name in files.where:
            source_of[name] = name
        else:  # a tied weight saved under another of its names
            alt = next((a for a, canonical in aliases.items() if canonical == name and a in files.where), None)
            if alt is not None:
                source_of[name] = alt
    missing = sorted(n for n in targets if n not in source_of)
    unexpected = sorted(n for n in files.names() if n not in set(source_of.values()) and n not in aliases)
    mismatched = []
    for name, source in source_of.items():
        spec, target = files.spec(source), targets[name]
        if tuple(spec.shape) != tuple(target.shape):
            mismatched.append(f"{source}: shape {list(spec.shape)} in {files.where[source].name}, "
                              f"model has {list(target.shape)}")
        elif spec.dtype != target.dtype and not (spec.dtype.is_floating_point and target.dtype.is_floating_point):
            mismatched.append(f"{source}: dtype {spec.dtype} in {files.where[source].name}, model has {target.dtype}")
    problems = []
    if missing:
        problems.append(f"missing keys ({len(missing)}): {', '.join(missing)}")
    if unexpected and strict:
        problems.append(f"unexpected keys ({len(unexpected)}): {', '.join(unexpected)}")
    if mismatched:
        problems.append(f"mismatched ({len(mismatched)}): " + "; ".join(mismatched))
    if problems:
        raise CheckpointError(f"{files.directory} does not match the model:\n  " + "\n  ".join(problems))
    return source_of


def read_tensors(targets: dict[str, torch.Tensor], files: CheckpointFiles, source_of: dict[str, str], *,
                 progress: bool | None = None, views: dict[str, tuple[DiskView, torch.Tensor]] | None = None) -> None:
    """Fill each target's local rows from `files` (as matched by `match_tensors`). Floats are cast.
    `views`: targets that are a slice of a model tensor (see `key_conversion`): name -> (view, tensor)."""
    total = sum(files.spec(s).nbytes for s in source_of.values())
    with _progress(total, f"loading {files.directory.name}", progress) as bar, torch.no_grad():
        for name, source in source_of.items():
            view, target = views[name] if views and name in views else (None, targets[name])
            start, stop, cols = block_range(target)
            local = local_tensor(target)
            where = slice(None)
            if view is not None:
                if cols is not None:
                    raise CheckpointError(f"{source}: a converted (per-expert) tensor split by columns is not read")
                start, stop, where = view.rows_from(start, stop)
            if stop > start and cols is not None:  # a tensor-parallel rowwise split: whole rows, then its columns
                local.copy_(files.read_rows(source, start, stop)[:, cols[0]:cols[1]])
            elif stop > start:
                out = local[where] if view is not None else local.view(local.shape) if local.dim() else local
                files.read_rows(source, start, stop, out=out)
            bar.update(files.spec(source).row_bytes * (stop - start))


def load_tensors(targets: dict[str, torch.Tensor], files: CheckpointFiles, *, aliases: dict[str, str] | None = None,
                 strict: bool = True, progress: bool | None = None) -> None:
    """Check every key first (one error listing all problems), then fill each target's local rows.
    No collectives."""
    read_tensors(targets, files, match_tensors(targets, files, aliases=aliases, strict=strict), progress=progress)


def existing_dir(directory: Path) -> Path:
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a directory.")
    return directory


class WeightsPlan:
    """What `load_pretrained` will read, checked against the model, before anything changes."""

    def __init__(self, parts: ModelParts, directory: Path, strict: bool = True):
        self.model = model = parts.model
        if parts.has_peft and ((directory / ADAPTER_FILE).exists()
                               or (directory / (ADAPTER_FILE + INDEX_SUFFIX)).exists()):
            self.targets, self.files = adapter_tensors(model), CheckpointFiles(directory, ADAPTER_FILE)
            aliases, base = None, None  # PEFT's adapter keys: no transformers conversion
        else:
            base = parts.base
            self.targets, self.files = model_tensors(base), CheckpointFiles(directory, SINGLE_FILE)
            aliases = tied_aliases(base)
            if base is not model:  # the base model's own weights under its own names; adapters stay as they are
                self.targets = {hf: t for n, t in self.targets.items() if (hf := base_model_name(n)) is not None}
                aliases = {base_model_name(a): base_model_name(c) for a, c in aliases.items()}
        self.views = None
        self.quantized: dict[str, quantized.QuantizedWeight] = {}
        try:
            if base is not None:
                self._quantized_targets(base)
                self._use_disk_names(base)
            self.source_of = match_tensors(self.targets, self.files, aliases=aliases, strict=strict)
        except BaseException:
            self.close()
            raise

    def _quantized_targets(self, model: nn.Module) -> None:
        """A sharded quantized weight is read as the float [out, in] tensor a checkpoint holds (stock
        `save_pretrained` of the unquantized model), and each rank quantizes its own rows; its side data
        (scales) is computed, not read."""
        weights = quantized.weights(model)
        side = {id(p) for weight in weights.values() for p in weight.side}
        for name, tensor in list(self.targets.items()):
            if id(tensor) in side:
                del self.targets[name]
                continue
            weight = weights.get(id(tensor))
            if weight is None:
                continue
            self.quantized[name] = weight
            self.targets[name] = torch.empty(weight.out_features, weight.in_features, dtype=weight.dtype, device="meta")

    def _use_disk_names(self, model: nn.Module) -> None:
        """Expect the names stock `save_pretrained` writes where transformers converts this model (MoE
        experts one tensor each, renamed modules), unless the files hold the in-memory names (written
        by hf_fsdp2 before it reverted conversions, or by `torch.save(model.state_dict())` tools)."""
        views = disk_views(model, self.targets)
        if views is None or all(name in self.files.where for name in self.targets):
            return
        memory = self.targets
        self.views = {v.name: (v, memory[v.source]) for v in views}
        self.targets = {v.name: torch.empty(v.shape, dtype=memory[v.source].dtype, device="meta") for v in views}

    def read(self, progress: bool | None = None) -> None:
        try:
            plain = {n: s for n, s in self.source_of.items() if n not in self.quantized}
            read_tensors(self.targets, self.files, plain, progress=progress, views=self.views)
            with torch.no_grad():
                for name, weight in self.quantized.items():  # the same order on every rank (collective)
                    start, stop = row_range(weight.packed)
                    weight.load_rows(self.files.read_rows(self.source_of[name], start, stop))
            engine.weights_replaced(self.model)  # what the techniques derive from the weights (collective)
        finally:
            self.close()

    def close(self) -> None:
        self.files.close()
