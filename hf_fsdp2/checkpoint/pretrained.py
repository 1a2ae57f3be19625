"""Hugging Face–format save and load of sharded models, with no gather.

`save_pretrained` writes `config.json` and `model.safetensors` (or shards + index) — or, for a
`PeftModel`, `adapter_model.safetensors` + `adapter_config.json` — with every rank writing its
own rows; `load_pretrained` reads back only each rank's rows; `from_pretrained` builds a model on
the meta device, shards it and loads it, so the full model never exists on any rank.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch
import torch.nn as nn
from tqdm.auto import tqdm

from . import async_save
from .async_save import SaveHandle
from .atomic_dir import committed_directory
from .key_conversion import DiskView, disk_views
from ..config import FSDP2Config, parse_dtype
from ..runtime import collectives, upstream
from ..runtime.distributed import local_tensor
from ..runtime.distributed import build_mesh
from .safetensors_io import (
    INDEX_SUFFIX, SINGLE_FILE, CheckpointError, CheckpointFiles, FileWriter, plan_checkpoint, write_json,
)
from ..sharding import shard_model
from ..quantization import bnb_4bit, fp8
from .lora_merge import base_model_name, merged_tensors
from .tensor_export import (
    ExportTensor, adapter_tensors, is_peft_model, model_tensors, row_range, tied_aliases,
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
    with _progress(total, f"saving {directory.name} (rank 0 share)", progress) as bar, torch.no_grad():
        for layout in layouts:
            with FileWriter(directory / layout.filename, layout, create=collectives.rank() == 0, durable=durable) as writer:
                for lay, name, start, stop in work:
                    if lay is not layout or stop <= start:
                        continue
                    bar.update(writer.write_rows(name, start, by_name[name].block()))
    if index is not None and collectives.rank() == 0:
        if total_parameters is not None:  # stock save_pretrained: {"total_parameters", "total_size"}
            index["metadata"] = {"total_parameters": total_parameters, **index["metadata"]}
        write_json(directory / (weights_name + INDEX_SUFFIX), index, durable=durable)


def export_items(model: nn.Module, dtype: torch.dtype | None, merge_adapters: bool) -> tuple[list[ExportTensor], bool]:
    """(items, is_adapter) for `model` as `save_pretrained` writes it."""
    if is_peft_model(model):
        if merge_adapters:
            return _as_on_disk(model.get_base_model(), merged_tensors(model, dtype)), False
        tensors = adapter_tensors(model)
        if not tensors:
            raise ValueError("the PeftModel's adapter has no tensors to save; check its `target_modules`.")
        return [_item(n, t, dtype) for n, t in tensors.items()], True
    if merge_adapters:
        raise ValueError("`merge_adapters=True` needs a PeftModel; this model has no adapters.")
    quantized = [n for n, m in bnb_4bit.named_4bit_modules(model) if bnb_4bit.is_sharded_4bit(m)]
    if quantized:
        raise NotImplementedError(
            f"saving the packed 4-bit base weights ({quantized[0]}, ...) is not supported: train a PEFT adapter "
            "on the 4-bit model and save the adapter, or save it merged (merge_adapters=True) as a plain model.")
    return _as_on_disk(model, [_item(n, t, dtype) for n, t in model_tensors(model).items()]), False


def _as_on_disk(model: nn.Module, items: list[ExportTensor]) -> list[ExportTensor]:
    """`items` under the names and layout stock `save_pretrained` writes (transformers' conversion
    mapping reverted, e.g. fused MoE experts split into one tensor per expert), in its order."""
    views = disk_views(model, {item.name: item.tensor for item in items})
    if views is None:
        return items
    by_name = {item.name: item for item in items}
    return [dataclasses.replace(by_name[v.source], name=v.name, view=v) for v in views]


def _item(name: str, tensor: torch.Tensor, dtype: torch.dtype | None) -> ExportTensor:
    return ExportTensor(name, tensor, dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype)


def write_configs(model: nn.Module, directory: Path, is_adapter: bool, dtype: torch.dtype | None) -> None:
    """config.json / generation_config.json, or adapter_config.json (rank 0 only)."""
    if is_adapter:
        _write_adapter_config(model, directory)
        return
    base = model.get_base_model() if is_peft_model(model) else model
    config = getattr(base, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        # As stock save_pretrained sets them (modeling_utils.PreTrainedModel.save_pretrained): the class
        # (FSDP2's dynamic "FSDP<Class>" name removed) and the dtype of the weights on disk.
        config = copy.deepcopy(config)
        if getattr(config, "quantization_config", None) is not None:  # 4-bit weights are written dequantized
            del config.quantization_config
        config.architectures = [type(base).__name__.removeprefix("FSDP")]
        saved = dtype if dtype is not None else next(
            (p.dtype for p in base.parameters() if p.is_floating_point()), None)
        if saved is not None:
            config.dtype = str(saved).removeprefix("torch.")
        config.save_pretrained(str(directory))
    generation = getattr(base, "generation_config", None)
    if generation is not None and hasattr(base, "can_generate") and base.can_generate():
        generation.save_pretrained(str(directory))


def _write_adapter_config(model: nn.Module, directory: Path) -> None:
    """adapter_config.json exactly as `PeftModel.save_pretrained` writes it (peft_model.py): the base
    model's name, `inference_mode=True`, and `auto_mapping` when no task type is set."""
    config = copy.deepcopy(model.peft_config[getattr(model, "active_adapter", "default")])
    if config.base_model_name_or_path is None:
        config.base_model_name_or_path = model.get_base_model().__dict__.get("name_or_path", None) or None
    config.inference_mode = True
    auto_mapping = None
    if config.task_type is None:
        base_class = model._get_base_model_class(is_prompt_tuning=config.is_prompt_learning)
        auto_mapping = {"base_model_class": base_class.__name__, "parent_library": base_class.__module__}
    config.save_pretrained(str(directory), auto_mapping_dict=auto_mapping)


def save_pretrained(model: nn.Module, save_directory: str | os.PathLike, *, dtype: torch.dtype | str | None = None,
                    max_shard_size: int | str | None = None, merge_adapters: bool = False,
                    write_extra: Callable[[Path], None] | None = None, progress: bool | None = None,
                    durable: bool = True, blocking: bool = True,
                    after_commit: Callable[[], None] | None = None) -> SaveHandle | None:
    """Save a sharded model in the Hugging Face layout, every rank writing only its own rows.

    Plain model: `config.json`, `model.safetensors` (or `model-0000k-of-0000n.safetensors` and
    `model.safetensors.index.json`). `PeftModel`: PEFT's adapter layout, loadable with
    `PeftModel.from_pretrained`; with `merge_adapters=True`, the full model with W + scale·B·A
    merged per local shard (this all-gathers only the small LoRA A matrices). `dtype` casts shard by
    shard. Under HSDP only replica 0 writes. The directory is replaced atomically (`atomic_dir`):
    only the files this save writes and a previous layout of the same weights file are replaced;
    everything else in it (tokenizer, README, other weights, subfolders) is kept byte for byte. `write_extra(staging_dir)` runs on rank 0 to add
    files (a tokenizer) that commit with the weights. Files and directories are fsynced before the
    commit; `durable=False` skips that (about 3x faster for small models here, see benchmarks/README.md):
    a crashed process still never leaves a partial directory, a crashed machine may.
    `blocking=False`: return a `SaveHandle` once this rank's rows are copied to host memory; writing
    and committing go on in the background (checkpoint/async_save.py). Any save first waits for the
    previous one. `after_commit()`: runs on rank 0 once the directory is committed (in the background
    too); see `committed_directory`.

    Collective: call on every rank. Apart from A matrices for merging, the only collectives are
    one-integer all-reduces that let every rank agree that the writes succeeded.
    """
    async_save.wait_pending()
    if not blocking and progress is None:
        progress = False  # no progress bar from the background in the middle of training's output
    dtype = parse_dtype(dtype, "dtype")
    items, is_adapter = export_items(model, dtype, merge_adapters)
    weights_name = ADAPTER_FILE if is_adapter else SINGLE_FILE
    if max_shard_size is None:
        max_shard_size = transformers_max_shard_size()
    total_parameters = None if is_adapter else sum(
        item.tensor.numel() for item in items if isinstance(item.tensor, nn.Parameter))

    def small_files(staging: Path) -> None:  # rank 0
        write_configs(model, staging, is_adapter, dtype)
        if write_extra is not None:
            write_extra(staging)

    def commit(items, small_files, group=None) -> None:
        with committed_directory(save_directory, weights_names=(weights_name,), what="saving",
                                 durable=durable, group=group, after_commit=after_commit) as staging:
            write_tensors(items, staging, weights_name=weights_name, max_shard_size=max_shard_size,
                          progress=progress, durable=durable, total_parameters=total_parameters)
            if collectives.rank() == 0:
                small_files(staging)

    if blocking:
        commit(items, small_files)
        return None
    return async_save.start(Path(save_directory).absolute(), commit, {"pretrained": items}, small_files, durable)


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
            start, stop = row_range(target)
            local = local_tensor(target)
            where = slice(None)
            if view is not None:
                start, stop, where = view.rows_from(start, stop)
            if stop > start:
                out = local[where] if view is not None else local.view(local.shape) if local.dim() else local
                files.read_rows(source, start, stop, out=out)
            bar.update(files.spec(source).row_bytes * (stop - start))


def load_tensors(targets: dict[str, torch.Tensor], files: CheckpointFiles, *, aliases: dict[str, str] | None = None,
                 strict: bool = True, progress: bool | None = None) -> None:
    """Check every key first (one error listing all problems), then fill each target's local rows.
    No collectives."""
    read_tensors(targets, files, match_tensors(targets, files, aliases=aliases, strict=strict), progress=progress)


def _existing_dir(directory: Path) -> Path:
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a directory.")
    return directory


class WeightsPlan:
    """What `load_pretrained` will read, checked against the model, before anything changes."""

    def __init__(self, model: nn.Module, directory: Path, strict: bool = True):
        self.model = model
        if is_peft_model(model) and ((directory / ADAPTER_FILE).exists()
                                     or (directory / (ADAPTER_FILE + INDEX_SUFFIX)).exists()):
            self.targets, self.files = adapter_tensors(model), CheckpointFiles(directory, ADAPTER_FILE)
            aliases, base = None, None  # PEFT's adapter keys: no transformers conversion
        else:
            base = model.get_base_model() if is_peft_model(model) else model
            self.targets, self.files = model_tensors(base), CheckpointFiles(directory, SINGLE_FILE)
            aliases = tied_aliases(base)
            if base is not model:  # the base model's own weights under its own names; adapters stay as they are
                self.targets = {hf: t for n, t in self.targets.items() if (hf := base_model_name(n)) is not None}
                aliases = {base_model_name(a): base_model_name(c) for a, c in aliases.items()}
        self.views = None
        self.quantized: dict[str, nn.Module] = {}
        try:
            if base is not None:
                self._quantize_4bit_targets(base)
                self._use_disk_names(base)
            self.source_of = match_tensors(self.targets, self.files, aliases=aliases, strict=strict)
        except BaseException:
            self.close()
            raise

    def _quantize_4bit_targets(self, model: nn.Module) -> None:
        """A sharded 4-bit weight is read as the float [out, in] tensor a checkpoint holds (stock
        `save_pretrained` of the unquantized model), and each rank quantizes its own rows."""
        modules = bnb_4bit.sharded_4bit_weights(model)
        for name, tensor in list(self.targets.items()):
            module = modules.get(id(tensor))
            if module is None:
                continue
            spec = bnb_4bit.spec_of(module)
            self.quantized[name] = module
            self.targets[name] = torch.empty(spec.out_features, spec.in_features, dtype=spec.dtype, device="meta")
            del self.targets[name + "_absmax"]

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
                for name, module in self.quantized.items():  # the same order on every rank (collective)
                    start, stop = row_range(module.weight)
                    rows = self.files.read_rows(self.source_of[name], start, stop)
                    bnb_4bit.finish_quantization(module, bnb_4bit.quantize_rows(module, rows))
            # FP8 weights' all-gather scales belong to the weights just read, not the ones they replaced:
            # a resumed run's first step must gather as the saving run's next one would have.
            fp8.precompute_scales(self.model)
        finally:
            self.close()

    def close(self) -> None:
        self.files.close()


def load_pretrained(model: nn.Module, directory: str | os.PathLike, *, strict: bool = True,
                    progress: bool | None = None) -> nn.Module:
    """Fill a sharded model from a Hugging Face directory, each rank reading only its own rows.

    Reads what `save_pretrained` (ours or transformers') writes: one file or an index and shards.
    For a `PeftModel` and a directory with `adapter_model.safetensors`, loads the adapter only.
    Every key, shape and dtype is checked before any weight changes.
    Collective: call on every rank (every rank reads its rows in parallel; FP8 models then all-reduce their scales).
    """
    async_save.wait_pending()  # a save still in flight may be of this very directory
    WeightsPlan(model, _existing_dir(Path(directory)), strict).read(progress)
    return model


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Create parameters on the meta device and buffers for real, so non-persistent buffers that
    checkpoints do not carry (rotary `inv_freq`) keep the values the model's constructor computed."""
    def on_meta(original):
        def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
            original(module, name, param)
            if param is not None and param.device.type != "meta":
                module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        return register

    with upstream.scoped("torch.nn.Module.register_parameter", on_meta):
        yield


def from_pretrained(model_class, directory: str | os.PathLike, config: FSDP2Config | None = None, *,
                    mesh=None, torch_dtype: torch.dtype | str | None = None, progress: bool | None = None,
                    quantization_config=None, peft_config=None, **model_kwargs) -> nn.Module:
    """Build `model_class` from `directory`'s config on the meta device, shard it, then load each
    rank's rows. The full model never exists on any rank.

    `quantization_config`: a `BitsAndBytesConfig(load_in_4bit=True, ...)`; the linear layers
    transformers would quantize become 4-bit, each rank quantizing only the rows it holds of the
    float checkpoint (quantization/bnb_4bit.py). `peft_config`: a PEFT config applied before
    sharding (a QLoRA model is built this way); its adapters are initialised by PEFT on rank 0 and
    broadcast, so every rank starts from the same adapter. Returns the `PeftModel` then.
    Collective: call on every rank.
    """
    directory = _existing_dir(Path(directory))
    torch_dtype = parse_dtype(torch_dtype, "torch_dtype")
    with parameters_on_meta():
        if hasattr(model_class, "config_class"):  # a model class
            model = model_class(model_class.config_class.from_pretrained(str(directory), **model_kwargs))
        else:  # an Auto class (AutoModelForCausalLM, ...)
            from transformers import AutoConfig

            model = model_class.from_config(AutoConfig.from_pretrained(str(directory), **model_kwargs))
    if torch_dtype is not None:
        model.to(torch_dtype)
    if quantization_config is not None:
        dtype = torch_dtype or next(p.dtype for p in model.parameters() if p.is_floating_point())
        bnb_4bit.quantize_on_meta(model, quantization_config, dtype)
    mesh = mesh if mesh is not None else build_mesh(config)
    if peft_config is not None:
        model = _with_adapters(model, peft_config, mesh)
    if quantization_config is not None:  # after PEFT, which reads the `Params4bit` attributes
        bnb_4bit.prepare_4bit_modules(model, dtype)
    shard_model(model, config, mesh=mesh, init_weights=False)
    load_pretrained(model, directory, progress=progress)
    base = model.get_base_model() if peft_config is not None else model
    if hasattr(base, "generation_config") and (directory / "generation_config.json").exists():
        from transformers import GenerationConfig

        base.generation_config = GenerationConfig.from_pretrained(str(directory))
    return model


def _with_adapters(model: nn.Module, peft_config, mesh) -> nn.Module:
    """`get_peft_model` on a meta model, then the adapters made real and initialised by PEFT's own
    `reset_lora_parameters` (PEFT leaves adapters of a meta base layer on meta), then rank 0's
    broadcast over `mesh` so they are identical on every rank."""
    from peft import get_peft_model
    from peft.tuners.lora import LoraLayer

    if str(getattr(peft_config, "peft_type", "")) not in ("LORA", "PeftType.LORA"):
        raise ValueError(f"`peft_config` must be a LoraConfig for hf_fsdp2.from_pretrained, got "
                         f"{type(peft_config).__name__}; apply other adapters before `shard_model` instead.")
    init = getattr(peft_config, "init_lora_weights", True)
    if init not in (True, False, "gaussian"):
        raise ValueError(f"`peft_config.init_lora_weights`={init!r} needs the base weights at initialisation; "
                         "hf_fsdp2.from_pretrained supports True, False and 'gaussian'.")
    model = get_peft_model(model, peft_config)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LoraLayer):
                for adapter in module.lora_A:
                    for factor in (module.lora_A[adapter], module.lora_B[adapter]):
                        # `init_lora_weights=False` keeps the layers' own init, which meta skipped
                        factor.to_empty(device="cpu").reset_parameters()
                    module.reset_lora_parameters(adapter, init)
        if collectives.world_size() > 1:
            for name, param in model.named_parameters():
                if ".lora_" in name and not param.is_meta:
                    collectives.broadcast_from_first(param.data, mesh)
    return model
