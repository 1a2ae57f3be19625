"""Sharding: groups.py decides which modules become which `fully_shard` group, memory.py computes what
a layout costs per rank, layout.py picks the cheapest layout that fits (`shard_size="auto"`),
compile.py compiles each decoder layer, engine.py applies it all (`shard_model`), and record.py holds
what hf_fsdp2 knows about a model it sharded (`record_of`).

Dependencies point one way: groups <- memory <- layout <- engine; compile <- engine; record <- all.
"""

from .engine import (  
    apply_activation_checkpointing,
    apply_fsdp,
    apply_fp8,
    materialize,
    no_sync,
    shard_model,
)
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
    unwrap_peft,
)

__all__ = [
    "ShardPlan", "ShardedModel", "is_sharded", "record_of", "apply_activation_checkpointing", "apply_fp8", "apply_frozen_dtype", "apply_fsdp", "canonical_name",
    "find_layers", "ignored_parameters", "materialize", "no_sync", "plan_groups", "resolve_layer_class_names",
    "resolve_shared_parameters", "shard_model", "size_based_groups", "unwrap_peft",
]
