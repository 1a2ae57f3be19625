"""Sharding: groups.py decides which modules become which `fully_shard` group, compile.py compiles each
decoder layer, engine.py applies it all to a layout already chosen (`shard_planned`), and record.py holds
what hf_fsdp2 knows about a model it sharded (`record_of`). What a layout costs and which one to take
(`shard_size="auto"`) is the planner's (hf_fsdp2/planner/); hf_fsdp2/shard.py joins the two.

Dependencies point one way: groups <- engine; compile <- engine; record <- all; the planner reads groups
and record, never the engine, and the engine never imports the planner. This file re-exports no name of the
engine: importing any module of sharding/ runs it, so the planner's imports would run the engine too; whoever
applies a layout imports `hf_fsdp2.sharding.engine` itself.
"""

from .record import ShardedModel, is_sharded, record_of
from .groups import (  
    ShardPlan,
    apply_frozen_dtype,
    canonical_name,
    find_layers,
    ignored_parameters,
    plan_groups,
    resolve_layer_class_names,
    resolve_shared_parameters,
    size_based_groups,
)
from .model_parts import ModelParts, model_parts

__all__ = [
    "ShardPlan", "ShardedModel", "is_sharded", "record_of", "apply_frozen_dtype", "canonical_name",
    "find_layers", "ignored_parameters", "plan_groups", "resolve_layer_class_names",
    "resolve_shared_parameters", "size_based_groups", "ModelParts", "model_parts",
]
