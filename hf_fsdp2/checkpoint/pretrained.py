"""Hugging Face–format save and load of sharded models, with no gather.

`save_pretrained` writes `config.json` and `model.safetensors` (or shards + index) — or, for a
`PeftModel`, `adapter_model.safetensors` + `adapter_config.json` — with every rank writing its
own rows; `load_pretrained` reads back only each rank's rows; `from_pretrained` builds a model on
the meta device, shards it and loads it, so the full model never exists on any rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import threading
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn as nn

from . import async_save, loading
from .async_save import SaveHandle
from .atomic_dir import committed_directory
from ..config import FSDP2Config, parse_dtype
from ..runtime import collectives, upstream
from ..runtime.distributed import build_mesh
from ..quantization import quantized
from ..sharding.model_parts import model_parts
from ..sharding.record import record_of
from .export_plan import export_items
from .weights_io import (
    ADAPTER_FILE, SINGLE_FILE, WeightsPlan, existing_dir, transformers_max_shard_size, write_configs,
    write_tensors,
)


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
    parts = model_parts(model)  # PEFT unwrapped once for the export and the configs
    # what adapter_config.json is written from, read with the parts (an adapter is saved unless merged)
    adapter = parts.saved_adapter() if parts.has_peft and not merge_adapters else None
    items, is_adapter = export_items(parts, dtype, merge_adapters)
    weights_name = ADAPTER_FILE if is_adapter else SINGLE_FILE
    if max_shard_size is None:
        max_shard_size = transformers_max_shard_size()
    total_parameters = None if is_adapter else sum(
        item.tensor.numel() for item in items if isinstance(item.tensor, nn.Parameter))

    def small_files(staging: Path) -> None:  # rank 0
        write_configs(parts, staging, adapter, dtype)
        if write_extra is not None:
            write_extra(staging)

    def commit(staged: dict[str, list], small_files, group=None) -> None:
        with committed_directory(save_directory, weights_names=(weights_name,), what="saving",
                                 durable=durable, group=group, after_commit=after_commit) as staging:
            write_tensors(staged["pretrained"], staging, weights_name=weights_name, max_shard_size=max_shard_size,
                          progress=progress, durable=durable, total_parameters=total_parameters)
            if collectives.rank() == 0:
                small_files(staging)

    if blocking:
        commit({"pretrained": items}, small_files)
        return None
    return async_save.start(Path(save_directory).absolute(), commit, {"pretrained": items}, small_files, durable)


def load_pretrained(model: nn.Module, directory: str | os.PathLike, *, strict: bool = True,
                    progress: bool | None = None) -> nn.Module:
    """Fill a sharded model from a Hugging Face directory, each rank reading only its own rows.

    Reads what `save_pretrained` (ours or transformers') writes: one file or an index and shards.
    For a `PeftModel` and a directory with `adapter_model.safetensors`, loads the adapter only.
    Every key, shape and dtype is checked before any weight changes.
    Collective: call on every rank (every rank reads its rows in parallel; FP8 models then all-reduce their scales).
    """
    return loading.read_directory(model, directory, strict=strict, progress=progress)


def check_pretrained(model: nn.Module, directory: str | os.PathLike) -> None:
    """What `load_pretrained` checks (every key, shape and dtype), without reading a weight; raises
    `CheckpointError` naming what does not match."""
    WeightsPlan(model_parts(model), existing_dir(Path(directory)), True).close()


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Create parameters on the meta device and buffers for real, so non-persistent buffers that
    checkpoints do not carry (rotary `inv_freq`) keep the values the model's constructor computed."""
    def on_meta(original):
        def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
            original(module, name, param)
            if param is not None and param.device.type != "meta":
                upstream.set_entry(module, "_parameters", name, nn.Parameter(
                    param.to("meta"), requires_grad=param.requires_grad), "torch.nn.Module._parameters")
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

    Other keywords: an `FSDP2Config` field (`ep_size=2`, `activation_checkpointing=True`, ...) is honoured, the
    config built from those keywords (with `config=` too, refused: give one or the other); the rest go to the
    model's config as transformers' `from_pretrained` passes them (`dtype`, `use_cache`, ...), and a keyword it does
    not take is refused by name rather than dropped.
    Collective: call on every rank.
    """
    directory = existing_dir(Path(directory))
    config = _config_with_keywords(config, model_kwargs)
    torch_dtype = parse_dtype(torch_dtype, "torch_dtype")
    model = build_on_meta(model_class, directory, torch_dtype, **model_kwargs)
    if quantization_config is not None:
        dtype = torch_dtype or next(p.dtype for p in model.parameters() if p.is_floating_point())
        quantized.quantize_on_meta(model, quantization_config, dtype)
    base = model  # the transformers model, before PEFT wraps it
    config = config or FSDP2Config()
    if config.is_auto_layout and mesh is not None:
        raise ValueError("`shard_size`='auto' chooses the device mesh itself; call from_pretrained without `mesh`.")
    if mesh is None and not config.is_auto_layout:
        mesh = build_mesh(config)
    if peft_config is not None:
        model = _peft_model(model, peft_config)
    parts = model_parts(model)  # the entry: PEFT unwrapped and the record made once, handed to each step
    record = record_of(parts, create=True)
    if peft_config is not None:
        # With shard_size="auto" the mesh follows the plan, made below on the meta model with its
        # adapters; their broadcast needs only a group over every rank.
        loading.init_meta_adapters(parts, mesh or build_mesh(config.replace(shard_size=None, memory_budget=None)))
    if quantization_config is not None:  # after PEFT, which reads the `Params4bit` attributes
        quantized.prepare(model, dtype)
    # Planned from shapes (the auto layout too): no rank ever holds the unsharded weights.
    fill = loading.FromDirectory(directory, progress)
    loading.shard_and_fill(model, loading.plan_for(parts, config, fill, mesh=mesh, record=record), fill)
    if hasattr(base, "generation_config") and (directory / "generation_config.json").exists():
        from transformers import GenerationConfig

        base.generation_config = GenerationConfig.from_pretrained(str(directory))
    return model


_FIELDS = tuple(field.name for field in dataclasses.fields(FSDP2Config))


def _config_with_keywords(config: FSDP2Config | None, model_kwargs: dict) -> FSDP2Config | None:
    """`config`, or one built from the FSDP2Config fields among `model_kwargs` (taken out of it): transformers'
    config would take them as unknown keys and drop them."""
    if config is not None and not isinstance(config, FSDP2Config):
        raise TypeError(f"`config` must be an FSDP2Config (how to shard), got {type(config).__name__}; the model's "
                        "own config is read from `directory`, its settings given as keywords (`use_cache=False`).")
    fields = {name: model_kwargs.pop(name) for name in _FIELDS if name in model_kwargs}
    if not fields:
        return config
    if config is not None:
        given = ", ".join(f"{name}={value!r}" for name, value in fields.items())
        raise ValueError(f"hf_fsdp2.from_pretrained got `config` and FSDP2Config fields as keywords ({given}); "
                         f"give one: `config=config.replace({given})`.")
    return FSDP2Config(**fields)


def build_on_meta(model_class, directory: Path, torch_dtype: torch.dtype | None = None, *, config=None,
                  **model_kwargs) -> nn.Module:
    """`model_class` (a model or an Auto class) from `config` or `directory`'s, parameters on the meta device,
    in the dtypes transformers' `from_pretrained(..., dtype=torch_dtype)` gives them: built under `torch_dtype`
    as the default dtype (so buffers are as the model's init makes them: RoPE's `inv_freq` stays fp32), every
    floating parameter in `torch_dtype` but those transformers keeps in fp32 at that dtype (its
    `_get_dtype_plan`: `_keep_in_fp32_modules` for fp16, `_keep_in_fp32_modules_strict` for fp16 and bf16),
    which are fp32, buffers of those too."""
    with _building:
        return _build_on_meta(model_class, directory, torch_dtype, config=config, **model_kwargs)


# torch's default dtype is the process's: ranks that are threads of one process (tools/local_ranks.py) build one at
# a time, so one's restore cannot undo another's setting (a thread creating floating tensors meanwhile still meets it).
_building = threading.Lock()


def _build_on_meta(model_class, directory: Path, torch_dtype: torch.dtype | None, *, config, **model_kwargs):
    previous = torch.get_default_dtype()
    if torch_dtype is not None and torch_dtype.is_floating_point:
        torch.set_default_dtype(torch_dtype)
    try:
        with parameters_on_meta():
            if config is not None:
                model = model_class(config) if hasattr(model_class, "config_class") else model_class.from_config(config)
            elif hasattr(model_class, "config_class"):  # a model class
                model = model_class(_model_config(model_class.config_class, directory, model_kwargs))
            else:  # an Auto class (AutoModelForCausalLM, ...)
                from transformers import AutoConfig

                model = model_class.from_config(_model_config(AutoConfig, directory, model_kwargs))
    finally:
        torch.set_default_dtype(previous)
    if torch_dtype is not None:
        _cast_as_transformers_loads(model, torch_dtype)
    return model


def _model_config(config_class, directory: Path, model_kwargs: dict):
    """`directory`'s config with `model_kwargs` set on it; a keyword the config does not take (transformers' config
    returns it unused, and its from_pretrained would pass it to the model's __init__, which hf_fsdp2 does not
    call with keywords) is refused by name."""
    config, unused = config_class.from_pretrained(str(directory), return_unused_kwargs=True, **model_kwargs)
    if unused:
        names = ", ".join(f"`{name}`={value!r}" for name, value in unused.items())
        raise ValueError(f"hf_fsdp2.from_pretrained: {names} is neither an FSDP2Config field nor a setting of "
                         f"{type(config).__name__}, so nothing would take it; leave it out.")
    return config


def _cast_as_transformers_loads(model: nn.Module, dtype: torch.dtype) -> None:
    keep = set(model._get_dtype_plan(dtype))  # transformers' own plan of what stays fp32 (5.6+)
    params = {id(p) for p in model.parameters()}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if not tensor.dtype.is_floating_point:
            continue
        if any(re.search(rf"(^|\.){re.escape(k)}($|\.)", name) for k in keep):
            wanted = torch.float32
        else:  # parameters take the dtype asked for; buffers stay as the model's init made them
            wanted = dtype if id(tensor) in params else tensor.dtype
        if tensor.dtype != wanted:
            tensor.data = tensor.data.to(wanted)


def _with_adapters(model: nn.Module, peft_config, mesh) -> nn.Module:
    """`get_peft_model` on a meta model, then the adapters made real and initialised by PEFT's own
    `reset_lora_parameters` (PEFT leaves adapters of a meta base layer on meta), then rank 0's
    broadcast over `mesh` so they are identical on every rank."""
    model = _peft_model(model, peft_config)
    loading.init_meta_adapters(model_parts(model), mesh)
    return model


def _peft_model(model: nn.Module, peft_config) -> nn.Module:
    """`get_peft_model` on a meta model, for a LoRA config whose initialisation needs no base weights."""
    from peft import get_peft_model

    if str(getattr(peft_config, "peft_type", "")) not in ("LORA", "PeftType.LORA"):
        raise ValueError(f"`peft_config` must be a LoraConfig for hf_fsdp2.from_pretrained, got "
                         f"{type(peft_config).__name__}; apply other adapters before `shard_model` instead.")
    init = getattr(peft_config, "init_lora_weights", True)
    if init not in (True, False, "gaussian"):
        raise ValueError(f"`peft_config.init_lora_weights`={init!r} needs the base weights at initialisation; "
                         "hf_fsdp2.from_pretrained supports True, False and 'gaussian'.")
    return get_peft_model(model, peft_config)
