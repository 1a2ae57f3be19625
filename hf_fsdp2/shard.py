"""`shard_model`: the layout planned (hf_fsdp2/planner/, when `shard_size="auto"`), then the model sharded
(hf_fsdp2/sharding/engine.py). The one place the two are joined, so the engine never imports the
planner: it is handed a config whose layout is already resolved."""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .config import FSDP2Config
from .planner.layout import resolve_auto_layout
from .sharding import engine


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
    if engine.adopt_if_sharded_at_load(model, config, mesh):
        return model
    engine.prepare_for_planning(model, config, mesh)
    return engine.shard_planned(model, resolve_auto_layout(model, config), mesh=mesh, init_weights=init_weights)


__all__ = ["shard_model"]
