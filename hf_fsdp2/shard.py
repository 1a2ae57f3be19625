"""The layout planned once, then the model sharded: `plan` (hf_fsdp2/planner/, when `shard_size="auto"`)
gives a `Layout`, the resolved config and its mesh in one object; the engine (hf_fsdp2/sharding/engine.py)
shards with it. The one place the two are joined, so the engine never imports the planner.
`shard_model` is both for a model that initialises itself; checkpoint/loading.py fills one from elsewhere.
"""

from __future__ import annotations

import dataclasses
import math

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .config import FSDP2Config
from .planner.layout import resolve_auto_layout
from .runtime.distributed import build_mesh
from .sharding import engine
from .sharding.model_parts import ModelParts, model_parts
from .sharding.record import ShardedModel, record_of


@dataclasses.dataclass(frozen=True)
class Layout:
    """A planned layout: `config` with no `shard_size="auto"` left, and the mesh it shards over; the model's parts
    and record as the entry looked them up, handed on to the sharding (None: looked up there)."""

    config: FSDP2Config
    mesh: DeviceMesh
    parts: ModelParts | None = None
    record: ShardedModel | None = None


def plan(model: nn.Module | ModelParts, config: FSDP2Config, *, mesh: DeviceMesh | None = None,
         to_device: bool = True, record: ShardedModel | None = None) -> Layout:
    """The model prepared for planning (refusals, its device unless `to_device=False`, quantized layers in
    the row layout FSDP2 shards), the auto layout resolved (a given mesh keeps its data-parallel shape:
    Accelerate's, with TP or CP), and the mesh built unless given. `model`: a model, or the parts an entry made
    with `record` its record; the returned layout carries both on. Collective: call on every rank."""
    parts = model if isinstance(model, ModelParts) else model_parts(model)  # a bare model: looked up here, once
    record = record if record is not None else record_of(parts, create=True)
    engine.prepare_for_planning(parts, to_device=to_device, record=record)
    shape = data_parallel_shape(mesh) if mesh is not None and config.is_auto_layout else None
    config, layout_plan = resolve_auto_layout(parts, config, mesh_shape=shape)
    if layout_plan is not None:  # what chose the layout, for whoever asks later (the record's `layout`)
        record.layout = layout_plan
    return Layout(config, mesh if mesh is not None else build_mesh(config), parts, record)


def data_parallel_shape(mesh: DeviceMesh) -> tuple[int, int]:
    """(replicate, shard) of a mesh: FSDP2 shards over every dimension but dp_replicate and tp (dp_shard, and cp or
    sp where the ranks split sequences: Accelerate's names, and ours)."""
    sizes = dict(zip(mesh.mesh_dim_names or (), mesh.shape))
    return sizes.get("dp_replicate", 1), math.prod(size for name, size in sizes.items()
                                                   if name not in ("dp_replicate", "tp"))


def shard_model(
    model: nn.Module,
    config: FSDP2Config | None = None,
    *,
    mesh: DeviceMesh | None = None,
    init_weights: bool = True,
) -> nn.Module:
    """Shard a Hugging Face model (or a `PeftModel`) with FSDP2, in place; returns it.

    Order: the auto layout (`shard_size="auto"`: planned before anything is allocated), frozen dtype,
    activation checkpointing, regional compilation, then `fully_shard` per decoder layer (frozen base
    weights and LoRA adapters in one group), embedding group, [final norm, lm_head] group, root.
    A model on the meta device is sharded first and then only local shards are allocated and
    initialised by the model's own init (`init_weights=False` leaves them for a loader).

    Collective: call on every rank.
    """
    config = config or FSDP2Config()
    parts = model_parts(model)  # the entry: PEFT unwrapped and the record looked up once, handed to each step
    record = record_of(parts, create=True)
    if engine.adopt_if_sharded_at_load(parts, record, config, mesh):
        return model
    if config.is_auto_layout and mesh is not None:
        raise ValueError("`shard_size`='auto' chooses the device mesh itself; call shard_model without `mesh`.")
    layout = plan(parts, config, mesh=mesh, record=record)
    return engine.shard_planned(parts, layout.config, mesh=layout.mesh, init_weights=init_weights, record=record)


__all__ = ["Layout", "data_parallel_shape", "plan", "shard_model"]
