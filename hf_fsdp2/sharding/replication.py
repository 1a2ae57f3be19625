"""Replication at DDP's speed: a layout whose shard groups are one rank each (S=1: every rank holds a
whole replica) is trained by torch's composable `replicate` (DDP's C++ reducer) instead of FSDP2.

Why: FSDP2 with one-rank shard groups still copies every parameter into an "all-gathered" buffer and
every gradient into a reduce buffer each step, and steps an optimizer over DTensors
(benchmarks/README.md: 0.84-0.93x DDP's tokens/s). Under `replicate` parameters stay plain tensors used
in place and gradients are all-reduced in buckets while backward runs, as DDP does; the model keeps its
class (torch makes it a `DDP<Name>` subclass, as `fully_shard` makes an `FSDP<Name>`), so
`set_requires_gradient_sync` (Accelerate's and our `no_sync`) works unchanged, and checkpoints read
plain tensors as whole rows (checkpoint/tensor_export.py).

What only FSDP2 provides keeps the layout on FSDP2 with one-rank groups, said once on rank 0 with the
reason (`fsdp_only_reasons`): FP8 all-gather, CPU offload, a reduce or output dtype other than the
gradients', tensor or context parallelism. A compute cast (`param_dtype`, Accelerate's `mixed_precision`)
is applied per group as FSDP2 applies it (sharding/compute_cast.py).

DDP's rules come with it: gradients are averaged only for forwards through the model itself (its root
hook prepares the reducer), so a decoder layer run under autograd outside the model's forward is refused
by name (`_refuse_layer_outside_model`) instead of training with unsynchronised gradients; a model that
skips some trainable parameters in a step needs `find_unused_parameters=True`, as with DDP.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn as nn
from torch.distributed._composable.replicate import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from ..config import FSDP2Config
from ..runtime import collectives, upstream
from ..runtime.distributed import REPLICATE_DIM, SHARD_DIM
from . import compute_cast
from .groups import ShardPlan, ignored_modules
from .record import ShardedModel

# transformers' buffers (rotary inv_freq, position ids) are the same on every rank; FSDP2 does not sync them
# either, and a buffer broadcast per forward would hang uneven generate() loops. torch 2.13 names that DDP setting
# `forward_sync_buffers` (its old `broadcast_buffers` deprecated); 2.11, the GPU image's, knows `broadcast_buffers`
# only (False there also skips the buffers' sync at init: equal buffers, nothing lost)
NO_BUFFER_SYNC_PER_FORWARD = ({"forward_sync_buffers": False}
                              if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
                              else {"broadcast_buffers": False})


def trains_on_reducer(replicate_size: int, shard_size: int, other_dims: int, config: FSDP2Config) -> bool:
    """Whether a layout (replicas x shard size x the product of the TP/CP sizes) trains on DDP's reducer
    when the model needs nothing FSDP2-only (`fsdp_only_reasons`): the one rule the engine and the
    memory estimate share."""
    return replicate_size > 1 and shard_size == 1 and other_dims == 1 and config.replication == "ddp"


def mesh_trains_on_reducer(mesh: DeviceMesh, config: FSDP2Config) -> bool:
    sizes = dict(zip(mesh.mesh_dim_names or (), mesh.shape))
    replicas, shard = sizes.get(REPLICATE_DIM, 1), sizes.get(SHARD_DIM, 1)
    return trains_on_reducer(replicas, shard, mesh.size() // (replicas * shard), config)


def fsdp_only_reasons(model: nn.Module, config: FSDP2Config) -> list[str]:
    """What in `config` needs FSDP2 even with one-rank shard groups (empty: DDP's reducer can train it)."""
    reasons = config.not_done_with("replication")  # config.py's table: what only FSDP2 applies
    trainable = {p.dtype for p in model.parameters() if p.requires_grad}
    if config.reduce_dtype is not None and trainable - {config.reduce_dtype}:
        reasons.append(f"`reduce_dtype`={config.reduce_dtype} (gradients are {sorted(map(str, trainable))})")
    if config.output_dtype is not None:
        reasons.append(f"`output_dtype`={config.output_dtype} (FSDP2's root casts its outputs)")
    return reasons


def apply_replication(model: nn.Module, plan: ShardPlan, config: FSDP2Config, mesh: DeviceMesh,
                      record: ShardedModel) -> bool:
    """`replicate` the model over `mesh`'s one replica group; False (nothing applied) when the model has
    no trainable parameter (a reference or reward model: plain replicas, nothing to reduce). `record`: the
    model's, which keeps the compute cast."""
    if not any(p.requires_grad for p in model.parameters()):
        return False
    ignored = ignored_modules(model, config.ignored_modules)  # Accelerate's fsdp_ignored_modules
    replicate(
        model,
        ignored_modules=ignored,
        process_group=_replica_group(mesh),
        device_id=collectives.mesh_device(mesh),
        **NO_BUFFER_SYNC_PER_FORWARD,
        # Gradients are views of DDP's buckets: no second copy of every gradient, no copy into the buckets.
        gradient_as_bucket_view=True,
        find_unused_parameters=config.find_unused_parameters,
        bucket_cap_mb=config.bucket_cap_mb,
    )
    _name_our_setting_in_ddp_errors(model)
    # `synchronize` builds the reducer before the first forward, after which torch's `register_comm_hook`
    # on the model would only queue the hook (it is applied at that lazy init): apply a queued one here.
    model.register_forward_pre_hook(_apply_queued_comm_hooks, prepend=True)
    compute_cast.apply_compute_cast(model, plan, config.param_dtype, record, ignored)
    for layer in plan.layers:
        layer.register_forward_pre_hook(_refuse_layer_outside_model(model))
    return True


def _name_our_setting_in_ddp_errors(model: nn.Module) -> None:
    """DDP's "Expected to have finished reduction in the prior iteration" (a trainable parameter got no gradient
    in the last step) tells the user to pass `find_unused_parameters=True` to DistributedDataParallel, which
    they never built: `replicate`'s forward pre-hook (torch/distributed/_composable/replicate.py, registered
    with kwargs) is wrapped, in place in the model's hook dict, to raise the same error naming our settings."""
    state = _state(model)
    hooks = model._forward_pre_hooks
    for key, hook in list(hooks.items()):
        if hook == state.forward_pre_hook:
            hooks[key] = _naming_find_unused(hook)


def _naming_find_unused(hook):
    def pre_forward(module, args, kwargs):
        try:
            return hook(module, args, kwargs)
        except RuntimeError as error:
            if "find_unused_parameters" not in str(error):
                raise
            raise RuntimeError(
                "a trainable parameter got no gradient in the previous step, and with shard size 1 hf_fsdp2 trains on "
                "DDP's reducer, which must be told: set FSDP2Config(find_unused_parameters=True) (Accelerate: "
                "DistributedDataParallelKwargs(find_unused_parameters=True); Trainer: --ddp_find_unused_parameters "
                "true; or HF_FSDP2_FIND_UNUSED_PARAMETERS=1), freeze the parameters that do not train, or set "
                "shard_size > 1 (FSDP2 groups need neither). DDP's message follows.\n" + str(error)) from error
    return pre_forward


def synchronize(model: nn.Module, broadcast: bool) -> None:
    """Build DDP's reducer now, on every rank at the same point (torch defers it to the first forward,
    which may run on some ranks only, e.g. an evaluation on rank 0). `broadcast`: rank 0's parameters and
    buffers to every replica, as DDP does at construction (False when a loader fills them next)."""
    state = _state(model)
    if state is None or state.has_initialized:
        return
    upstream.set_entry(state, "_init_kwargs", "init_sync", broadcast,
                       "torch.distributed._composable.replicate._ReplicateState._init_kwargs")
    state.lazy_init()


def is_replicated(model: nn.Module) -> bool:
    return _state(model) is not None


def _state(model: nn.Module):
    from torch.distributed._composable.contract import _get_registry

    registry = _get_registry(model)
    return replicate.state(model) if registry is not None and "replicate" in registry else None


def _replica_group(mesh: DeviceMesh):
    return mesh.get_group(REPLICATE_DIM)


def _apply_queued_comm_hooks(model: nn.Module, args) -> None:
    state = _state(model)
    if state is not None and state.has_initialized and state._comm_hook_args:
        state.register_comm_hook()  # hands each queued (args, kwargs) to DDP's register_comm_hook, clears


def _refuse_layer_outside_model(model: nn.Module):
    state = _state(model)

    def check(module: nn.Module, args) -> None:
        # Inside backward (a checkpointed layer's recomputation) the reducer is already prepared.
        if (torch.is_grad_enabled() and DistributedDataParallel._active_ddp_module is not getattr(state, "_ddp", None)
                and torch._C._current_graph_task_id() == -1):
            raise RuntimeError(
                f"{type(module).__name__} ran under autograd outside the forward of the replicated "
                f"{type(model).__name__}: DDP averages gradients only for forwards through the model itself. "
                "Call the model, or set `shard_size` > 1 (FSDP2 groups sync per layer).")

    return check
