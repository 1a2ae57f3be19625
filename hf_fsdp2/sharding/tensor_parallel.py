"""Tensor parallelism (TP) under FSDP2, with transformers' own TP machinery.

transformers 5 ships each model's TP plan (`base_model_tp_plan`: colwise/rowwise linears, a rowwise
embedding, ...) and applies it with `transformers.distributed.tensor_parallel.apply_tensor_parallelism`
(parameters become DTensors on the "tp" mesh, forward hooks redistribute activations). `shard_model`
with `tp_size` > 1 resolves the plan the way `from_pretrained(distributed_config=...)` does
(`PreTrainedModel._resolve_parallel_plans`), applies it on the mesh's "tp" dimension, then FSDP2 shards
the result over the data-parallel dimensions: every parameter a DTensor on the (dp_shard, tp) mesh. A
model transformers already split (`from_pretrained(..., tp_plan="auto", device_mesh=mesh)` with our
mesh) is taken as it is.

Checkpoints stay gather-free: a colwise weight's rows and a rowwise weight's columns are this rank's
block of the file tensor (checkpoint/tensor_export.py `block_range`).

Not done, refused by name: PEFT adapters (LoRA's A/B are not in the TP plan, so their outputs would not
match the sharded base layer's), 4-bit and FP8 layers, regional compilation, models on the meta device
(load the weights, or let transformers load them split, first).
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .groups import unwrap_peft
from ..quantization import bnb_4bit
from ..runtime.distributed import TP_DIM


def is_tensor_parallel(model: nn.Module) -> bool:
    """Some parameter is a DTensor on a mesh with a "tp" dimension (TP applied, by us or transformers)."""
    return any(isinstance(p, DTensor) and TP_DIM in (p.device_mesh.mesh_dim_names or ())
               for p in model.parameters())


def refuse_unsupported(model: nn.Module, config, on_meta: bool) -> None:
    """What TP does not cover yet, refused by name before anything changes."""
    reason = None
    if unwrap_peft(model) is not model:
        reason = "PEFT adapters (their A/B layers are outside the model's TP plan)"
    elif any(True for _ in bnb_4bit.named_4bit_modules(model)):
        reason = "4-bit (bitsandbytes) layers"
    elif config.fp8:
        reason = "`fp8`"
    elif config.compile:
        reason = "`compile` (regional compilation)"
    elif on_meta:
        reason = ("a model on the meta device (load its weights first, or load it split with transformers' "
                  "from_pretrained(..., tp_plan='auto', device_mesh=mesh))")
    if reason:
        raise NotImplementedError(f"`tp_size`={config.tp_size} with {reason} is not done in hf_fsdp2; use tp_size=1.")


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """The model's own TP plan on `tp_mesh`, resolved and applied by transformers (every rank must hold
    the same full weights: each keeps its own part of them, with no communication)."""
    from transformers.distributed import DistributedConfig
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    resolve = getattr(model, "_resolve_parallel_plans", None)
    if resolve is None:
        raise ValueError(f"`tp_size`={tp_mesh.size()}: {type(model).__name__} is not a transformers model with a "
                         "tensor-parallel plan.")
    tp_plan, _, _ = resolve(DistributedConfig(tp_size=tp_mesh.size()))
    apply_tensor_parallelism(model, tp_mesh, tp_plan)
