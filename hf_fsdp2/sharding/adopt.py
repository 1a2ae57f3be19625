"""A model transformers sharded itself at load, taken as it is.

transformers 5.2x applies FSDP2 (and TP) while loading: `from_pretrained(...,
distributed_config=DistributedConfig(fsdp_size=..., tp_size=..., dp_replicate_size=...))` returns a
model already `fully_shard`-ed on transformers' own mesh ("dp_replicate", "fsdp", "tp"), with the
groups of its FSDP plan (transformers/distributed/fsdp.py `apply_fully_sharded_data_parallelism`:
each decoder layer, the embedding, norm + head, the root). `shard_model` keeps that sharding and adds
what hf_fsdp2 gives a model it sharded itself: gather-free checkpoints (every parameter is a DTensor
on that mesh; each rank's block is read off its placements, whatever the dimensions are called),
`generate()` gathering each group once, and the record the save/load/state code reads.

What would change how the model is sharded (other groups, precision, offload, checkpointing, FP8,
compilation, another layout) cannot be applied to a model that is already sharded: a config that asks
for it is refused by name, with the way out (load without `fsdp_size` and let hf_fsdp2 shard it).
"""

from __future__ import annotations

import dataclasses

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from ..config import SHARDING_FIELDS, TRANSFORMERS_DIM_SETTINGS, FSDP2Config

TRANSFORMERS_SHARD_DIM = "fsdp"  # transformers' name for the dimension FSDP2 shards over


def sharded_by_transformers(model: nn.Module) -> bool:
    """`fully_shard`-ed by someone else with transformers' mesh names (the "fsdp" dimension)."""
    mesh = _parameter_mesh(model)
    return (isinstance(model, FSDPModule) and mesh is not None
            and TRANSFORMERS_SHARD_DIM in (mesh.mesh_dim_names or ()))


def _parameter_mesh(model: nn.Module) -> DeviceMesh | None:
    return next((p.device_mesh for p in model.parameters() if isinstance(p, DTensor)), None)


def _dimension_size(model: nn.Module, dim: str) -> int:
    """The size of the mesh dimension `dim` in the first parameter mesh that has one, 1 without: transformers keeps
    a dense and an expert mesh (transformers/distributed/utils.py TransformersDeviceMesh), the dense one first."""
    for p in model.parameters():
        names = p.device_mesh.mesh_dim_names or () if isinstance(p, DTensor) else ()
        if dim in names:
            return p.device_mesh.shape[names.index(dim)]
    return 1


def refuse_adapters_added_after(parts) -> None:
    """PEFT applied to a model transformers sharded at load: its adapters are outside transformers' groups (plain
    tensors, every rank a whole copy), and LoRA on split experts would fold every expert into each rank's rows."""
    if parts.model is not parts.base and sharded_by_transformers(parts.base):
        raise NotImplementedError(
            f"PEFT wraps a {type(parts.base).__name__} that transformers sharded at load (DistributedConfig): hf_fsdp2 "
            "adopts such a model only as transformers left it, and PEFT's adapters added afterwards are in none of "
            "its groups. Load the model without `distributed_config` and give the sizes to hf_fsdp2 "
            "(FSDP2Config(shard_size=..., tp_size=..., ep_size=...)), which shards the base and its adapters.")


def adopted_config(model: nn.Module, config: FSDP2Config) -> tuple[FSDP2Config, DeviceMesh]:
    """The config that describes the sharding transformers applied (the caller's non-sharding fields,
    e.g. `async_save`, kept) and the model's mesh; refuses what can no longer be applied."""
    mesh = _parameter_mesh(model)
    sizes = dict(zip(mesh.mesh_dim_names, mesh.shape))
    actual = {"shard_size": sizes[TRANSFORMERS_SHARD_DIM],  # and config.py's settings of transformers' other dims
              **{name: _dimension_size(model, dim) for dim, name in TRANSFORMERS_DIM_SETTINGS.items()}}
    defaults = FSDP2Config()
    changed = [f"`{name}`={getattr(config, name)!r}" for name in SHARDING_FIELDS  # config.py's: they decide sharding
               if getattr(config, name) != getattr(defaults, name)]
    if config.layer_cls_names:  # fine when transformers made a group of each such layer too
        ungrouped = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.removeprefix("FSDP")
                            in config.layer_cls_names and not isinstance(m, FSDPModule)})
        if ungrouped or not any(type(m).__name__.removeprefix("FSDP") in config.layer_cls_names
                                for m in model.modules()):
            changed.append(f"`layer_cls_names`={config.layer_cls_names!r} (transformers grouped other modules)")
    changed += [f"`{name}`={getattr(config, name)!r} (the model's mesh has {actual[name]})"
                for name in TRANSFORMERS_DIM_SETTINGS.values() if getattr(config, name) not in (1, actual[name])]
    if config.shard_size not in (None, actual["shard_size"]):
        changed.append(f"`shard_size`={config.shard_size!r} (the model's mesh has {actual['shard_size']})")
    if changed:
        raise NotImplementedError(
            f"{type(model).__name__} was sharded at load by transformers (DistributedConfig, mesh {sizes}); "
            f"hf_fsdp2 keeps that sharding and cannot apply {', '.join(changed)}. Load the model without "
            "`fsdp_size` in its DistributedConfig to let hf_fsdp2 shard it with these settings.")
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(FSDP2Config)}
    values.update(actual)
    return FSDP2Config(**values), mesh
