"""One path from plan to loaded model: the layout planned once (hf_fsdp2/shard.py `plan`: config and mesh in
one object), then `shard_and_fill` with one of the ways a sharded model gets its values:

- `INITIALISE`: the model's own weights, or its own init on each rank's shards of a meta model;
- `FromRank0()`: rank 0's weights broadcast one tensor at a time, each rank keeping its rows
  (Accelerate's `fsdp_cpu_ram_efficient_loading`; the other ranks hold the model on meta);
- `FromDirectory(path)`: each rank reads its own rows of a Hugging Face directory (`hf_fsdp2.from_pretrained`,
  `load_pretrained`);
- `Deferred(path, values)`: a model transformers' `from_pretrained` built on meta (integrations/deferred_load.py):
  adapters PEFT added initialised, the directory's rows, then the values given to it before prepare.

Every loader of hf_fsdp2 goes through here: `hf_fsdp2.from_pretrained` (checkpoint/pretrained.py) and
Accelerate's prepare (integrations/accelerate.py).
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import torch
import torch.nn as nn

from ..config import FSDP2Config
from ..quantization import quantized
from ..runtime import collectives, upstream
from ..runtime.distributed import local_tensor
from ..shard import Layout, plan
from ..sharding import canonical_name, engine
from ..sharding.model_parts import ModelParts, model_parts
from ..sharding.record import ShardedModel, record_of
from . import async_save
from .tensor_export import block_range, model_tensors, row_range
from .weights_io import WeightsPlan, existing_dir

INITIALISE = "initialise"


@dataclasses.dataclass(frozen=True)
class FromRank0:
    pass


@dataclasses.dataclass(frozen=True)
class FromDirectory:
    path: Path
    progress: bool | None = None


@dataclasses.dataclass(frozen=True)
class Deferred:
    path: Path
    # the values given to the model before prepare, by name (integrations/deferred_load.py keep_changes), written
    # over the directory's rows
    values: dict = dataclasses.field(default_factory=dict)


Fill = str | FromRank0 | FromDirectory | Deferred


def plan_for(model: nn.Module | ModelParts, config: FSDP2Config, fill: Fill, *, mesh=None,
             record: ShardedModel | None = None) -> Layout:
    """`plan` for a model `fill` will fill. From rank 0: its quantized layers set the others' row layout first
    (their meta layers have no quantization state to read it from), and its weights stay where they are
    (broadcast from there, never moved whole to the device). `model`: a model, or the parts an entry made with
    `record` its record (the layout hands both to `shard_and_fill`). Collective: call on every rank."""
    parts = model if isinstance(model, ModelParts) else model_parts(model)  # a bare model: looked up here, once
    record = record if record is not None else record_of(parts, create=True)
    from_rank0 = isinstance(fill, FromRank0)
    if from_rank0:
        _prepare_quantized_from_rank0(parts.model, collectives.rank() == 0)
    return plan(parts, config, mesh=mesh, to_device=not from_rank0, record=record)


def shard_and_fill(model: nn.Module, layout: Layout, fill: Fill) -> nn.Module:
    """Shard `model` on `layout` and give its shards their values by `fill`; the parts and record the layout
    carries (`plan_for`'s) are handed on, else looked up here. Collective: call on every rank."""
    parts = layout.parts if layout.parts is not None and layout.parts.model is model else model_parts(model)
    record = layout.record if parts is layout.parts else None
    if fill == INITIALISE:
        return engine.shard_planned(parts, layout.config, mesh=layout.mesh, record=record)
    if isinstance(fill, FromRank0):
        return _fill_from_rank0(parts, layout, record)
    if isinstance(fill, Deferred):
        init_meta_adapters(parts, layout.mesh)
        engine.shard_planned(parts, layout.config, mesh=layout.mesh, init_weights=False, record=record)
        _read(parts, fill.path)
        _fill_peft_originals(parts)
        _restore_deferred_values(parts, fill.values)
        return model
    if isinstance(fill, FromDirectory):
        engine.shard_planned(parts, layout.config, mesh=layout.mesh, init_weights=False, record=record)
        _read(parts, fill.path, progress=fill.progress)
        _fill_peft_originals(parts)  # peft_config's modules_to_save (checkpoint/pretrained.py)
        return model
    raise TypeError(f"no such way to fill a sharded model: {fill!r}")


def read_directory(model: nn.Module, directory: str | os.PathLike, *, strict: bool = True,
                   progress: bool | None = None) -> nn.Module:
    """Fill a sharded model from a Hugging Face directory, each rank reading only its own rows (the body of
    `hf_fsdp2.load_pretrained`). Collective: call on every rank."""
    _read(model_parts(model), directory, strict=strict, progress=progress)
    return model


def _read(parts: ModelParts, directory: str | os.PathLike, *, strict: bool = True,
          progress: bool | None = None) -> None:
    async_save.wait_pending()  # a save still in flight may be of this very directory
    WeightsPlan(parts, existing_dir(Path(directory)), strict).read(progress)


# ---------------------------------------------------------------------------------------------
# Adapters of a meta model


def init_meta_adapters(parts: ModelParts, mesh) -> None:
    """LoRA adapters PEFT left on the meta device (their base layer is on meta) made real and initialised
    by PEFT's own `reset_lora_parameters` with each adapter's `init_lora_weights`, then rank 0's broadcast
    over `mesh` so every rank starts from the same adapters. Collective when the world has > 1 rank."""
    from peft.tuners.lora import LoraLayer

    model, configs = parts.model, parts.adapter_configs
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LoraLayer):
                for adapter in module.lora_A:
                    if not module.lora_A[adapter].weight.is_meta:
                        continue
                    for factor in (module.lora_A[adapter], module.lora_B[adapter]):
                        # `init_lora_weights=False` keeps the layers' own init, which meta skipped
                        factor.to_empty(device="cpu").reset_parameters()
                    init = getattr(configs.get(adapter), "init_lora_weights", True)
                    if init not in (True, False, "gaussian"):
                        raise ValueError(f"adapter {adapter!r}: `init_lora_weights`={init!r} needs the base weights "
                                         "at initialisation, which are not loaded yet (meta); True, False and "
                                         "'gaussian' are supported.")
                    module.reset_lora_parameters(adapter, init)
        if collectives.world_size() > 1:
            for name, param in model.named_parameters():
                if ".lora_" in name and not param.is_meta:
                    collectives.broadcast_from_first(param.data, mesh)


def _fill_peft_originals(parts: ModelParts) -> None:
    """PEFT's `modules_to_save` wraps a layer as `original_module` beside its copies (`modules_to_save.<adapter>`),
    all deep copies of the loaded layer; a read of the base model's directory fills the copies under the layer's
    name and not the original (weights_io: `base_model_name`), which the sharding left uninitialised, and which
    runs wherever the adapter is disabled (`disable_adapter()`: TRL's reference model). It takes a copy's values,
    as read. (After a read of the base checkpoint only: the fills of a meta model, never `load_pretrained`.)"""
    tensors = {canonical_name(n): t for n, t in [*parts.base.named_parameters(remove_duplicate=False),
                                                  *parts.base.named_buffers(remove_duplicate=False)]}
    with torch.no_grad():
        for name, original in tensors.items():
            layer, found, rest = name.partition(".original_module.")
            if not found:
                continue
            copy = re.compile(rf"{re.escape(layer)}\.modules_to_save\.[^.]+\.{re.escape(rest)}")
            source = next((t for n, t in tensors.items() if copy.fullmatch(n)), None)
            if source is None:
                continue
            if block_range(source) != block_range(original):  # one layer, one group: never seen
                raise ValueError(f"{name}: sharded unlike its modules_to_save copy; it cannot take the copy's rows")
            local_tensor(original).copy_(local_tensor(source))


def _restore_deferred_values(parts: ModelParts, kept: dict) -> None:
    """The values given to the deferred model before prepare (`kept`, by name: deferred_load, loaded with
    `load_state_dict`, or assigned real tensors), written over what the directory and the adapters' init gave:
    each rank its own block of every tensor. Every rank was given the same values, as init's broadcast or the
    directory would give."""
    if not kept:
        return
    tensors = {canonical_name(n): t for n, t in [*parts.base.named_parameters(remove_duplicate=False),
                                                  *parts.base.named_buffers(remove_duplicate=False)]}
    missing = sorted(set(kept) - set(tensors))
    if missing:
        raise ValueError(f"weights given to the model before prepare name no tensor of the prepared model: "
                         f"{missing[:5]}")
    with torch.no_grad():
        for name, value in kept.items():
            target = tensors[name]
            if tuple(target.shape) != tuple(value.shape):
                raise ValueError(f"{name} given before prepare: shape {tuple(value.shape)} does not fit the prepared "
                                 f"model's {tuple(target.shape)}")
            start, stop, cols = block_range(target)
            block = value[start:stop] if value.dim() else value
            local_tensor(target).copy_(block if cols is None else block[:, cols[0]:cols[1]])


# ---------------------------------------------------------------------------------------------
# Rank 0's weights (Accelerate's fsdp_cpu_ram_efficient_loading): transformers loads the checkpoint on rank 0
# (other ranks may hold meta tensors, or, with a quantized model, the same weights again). An empty model is
# sharded, then rank 0 broadcasts one tensor at a time and every rank keeps only its own rows: peak, one full
# tensor per rank. Quantized layers are first given the packed row layout on every rank, so what travels is
# rank 0's packed rows and scales, kept row by row as float weights are. For no full copy on any rank, load
# with `hf_fsdp2.from_pretrained` instead.

# What a quantized layer dequantizes to, as one number rank 0 sends (meta layers have no quantization state).
_DEQUANT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _prepare_quantized_from_rank0(model: nn.Module, is_source: bool) -> None:
    """Every rank's quantized layers in the same packed row layout: rank 0's are quantized; another rank's may
    be meta, so they take the dequantization dtype rank 0 sends. Collective when the model has quantized layers
    (every rank builds the same model, so all agree)."""
    layers = quantized.unprepared_layers(model)
    if not layers:
        return
    code = -1
    if is_source:
        dtypes = {name: q.source_dtype(name, m) for name, m, q in layers}
        if len(set(dtypes.values())) != 1 or next(iter(dtypes.values())) not in _DEQUANT_DTYPES:
            raise ValueError("`fsdp_cpu_ram_efficient_loading` with 4-bit layers of different dtypes "
                             f"({dtypes}) is not supported; load with hf_fsdp2.from_pretrained.")
        code = _DEQUANT_DTYPES.index(next(iter(dtypes.values())))
    code = collectives.all_reduce_int(code, "max")  # rank 0's: the others send -1
    quantized.prepare(model, _DEQUANT_DTYPES[code])


def _fill_from_rank0(parts: ModelParts, layout: Layout, record: ShardedModel | None) -> nn.Module:
    """Shard the model with rank 0's weights and buffers in every rank's shards."""
    model = parts.model
    mesh = layout.mesh
    device = collectives.mesh_device(mesh)  # NCCL broadcasts device tensors
    is_source = collectives.rank() == 0
    sources = dict(model_tensors(model)) if is_source else {}
    buffers = dict(model.named_buffers()) if is_source else {}
    meta: dict[int, nn.Parameter] = {}  # tied weights stay tied
    for module in model.modules():
        for key, param in module._parameters.items():
            if param is not None:
                if id(param) not in meta:
                    meta[id(param)] = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
                upstream.set_entry(module, "_parameters", key, meta[id(param)], "torch.nn.Module._parameters")
    engine.shard_planned(parts, layout.config, mesh=mesh, init_weights=False, record=record)
    with torch.no_grad():
        targets = list(model_tensors(model).items()) + [(f"buffer:{n}", b) for n, b in model.named_buffers()]
        for name, target in targets:
            source = buffers.get(name[len("buffer:"):]) if name.startswith("buffer:") else sources.get(name)
            if is_source and (source is None or source.is_meta):
                raise ValueError(f"`fsdp_cpu_ram_efficient_loading`: rank 0 has no weights for {name!r}; "
                                 "load the model with from_pretrained on rank 0 (or use hf_fsdp2.from_pretrained).")
            if is_source and source.shape != target.shape:
                raise ValueError(f"`fsdp_cpu_ram_efficient_loading`: {name!r} is {tuple(source.shape)} on rank 0 "
                                 f"and {tuple(target.shape)} here; every rank must build the same model.")
            full = (source.to(device=device, dtype=target.dtype).contiguous() if is_source
                    else torch.empty(target.shape, dtype=target.dtype, device=device))
            collectives.broadcast_from_first(full, mesh)
            start, stop = row_range(target)
            local = local_tensor(target)
            local.copy_(full[start:stop] if full.dim() else full)
    return model


__all__ = ["Deferred", "FromDirectory", "FromRank0", "INITIALISE", "init_meta_adapters", "plan_for",
           "read_directory", "shard_and_fill"]
