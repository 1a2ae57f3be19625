"""The sharding engine: activation checkpointing, then one `fully_shard` group per decoder layer,
an embedding group, a [final norm, lm_head] group and the root.

One small function per technique (torchtitan's `parallelize.py` is the model), called in order by
`shard_planned` with a layout already chosen (hf_fsdp2/shard.py plans it first).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Iterator, Mapping

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    CheckpointWrapper,
    checkpoint_wrapper,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from ..config import CP_DIM, SP_DIM, TP_DIM, FSDP2Config, no_cp_mesh
from ..quantization import fp8, quantized
from ..runtime import collectives, host_allocator, upstream
from ..runtime.distributed import (build_mesh, data_parallel_mesh, default_device, flattened, local_tensor,
                                   refuse_accelerator_model_on_host_backend)
from .compile import compile_layers, compiled_collectives, disable_cache_in_training, is_compiled
from .groups import ShardPlan, apply_frozen_dtype, plan_groups, replicated_frozen_parameters
from .model_parts import ModelParts, model_parts
from .generation import wrap_generate
from .record import ShardedModel, note_parameters, record_of, refuse_parameters_added_after, sharded
from . import (activation_offload, adopt, context_parallel, expert_parallel, grad_clip, replication,
               selective_checkpoint, sequence_parallel, sequence_tiling, tensor_parallel)


# ---------------------------------------------------------------------------------------------
# Techniques, applied in order


def weights_replaced(model: nn.Module) -> None:
    """What the techniques derive from the weights, computed again once a checkpoint's rows were read into the
    sharded model (checkpoint/weights_io.py): FP8's all-gather scales belong to the weights just read, not the ones
    they replaced, so a resumed run's first step gathers as the saving run's next one would have. Collective: call
    on every rank."""
    fp8.precompute_scales(model)


def apply_fp8(model: nn.Module, plan: ShardPlan) -> fp8.Fp8Conversion:
    """The decoder layers' linears to torchao Float8Linear with FP8 all-gather; what was kept and why
    is logged on rank 0 and kept by quantization/fp8.py (`fp8.conversion(model)`)."""
    conversion = fp8.convert(model, plan.layers)
    if collectives.rank() == 0:
        logging.getLogger("hf_fsdp2").warning(conversion.summary())
    return conversion


def apply_activation_checkpointing(model: nn.Module, layers: list[nn.Module], every: int = 1,
                                   save_matmuls: bool = False) -> list[nn.Module]:
    """Wrap every `every`-th layer (0, every, 2 x every, ...) in torch's non-reentrant
    `CheckpointWrapper`, in place; returns the layers with those replaced by their wrappers.
    `save_matmuls`: op-level selective checkpointing (selective_checkpoint.py).

    Applied before `fully_shard` so each wrapper becomes the group: FSDP's unshard happens outside
    the checkpointed region and again, through its pre-backward hook, for the recomputation.
    """
    chosen = {id(layer) for layer in selective_checkpoint.checkpointed_layers(layers, every)}
    wrapped: list[nn.Module] = []
    for layer in layers:
        if isinstance(layer, CheckpointWrapper) or id(layer) not in chosen:
            wrapped.append(layer)
            continue
        parent, name = _parent_of(model, layer)
        wrapper = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                     **selective_checkpoint.checkpoint_kwargs(save_matmuls))
        if save_matmuls:
            selective_checkpoint.without_cache_in_training(wrapper)
        parent.register_module(name, wrapper)
        wrapped.append(wrapper)
    return wrapped


def _parent_of(root: nn.Module, target: nn.Module) -> tuple[nn.Module, str]:
    for module in root.modules():
        for name, child in module.named_children():
            if child is target:
                return module, name
    raise AssertionError("layer not found under the model")


def _fsdp_kwargs(config: FSDP2Config, mesh: DeviceMesh) -> dict:
    offload: OffloadPolicy = (
        CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if config.cpu_offload else OffloadPolicy()
    )
    return {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=config.param_dtype,
            reduce_dtype=config.reduce_dtype,
            output_dtype=config.output_dtype,
        ),
        "offload_policy": offload,
    }


def apply_fsdp(model: nn.Module, plan: ShardPlan, config: FSDP2Config, mesh: DeviceMesh) -> None:
    """`fully_shard` bottom-up: each layer, the embedding, [norm, head], then the root."""
    kwargs = _fsdp_kwargs(config, mesh)
    # FP8's weights are gathered by FSDP2 in float8: none stays out of its groups
    frozen_outside = set() if config.fp8 else replicated_frozen_parameters(model, config, mesh.size(-1))
    ignored = plan.ignored_params | frozen_outside
    if ignored:
        kwargs["ignored_params"] = ignored
    reshard = config.reshard_after_forward
    if plan.inner_groups:  # inside the layers: sharded first, each its own group (EP's experts)
        # as its layer: the last one's backward runs right after forward, so its experts stay gathered too
        last = {id(m) for m in plan.layers[-1].modules()} if plan.layers and plan.in_forward_order else set()
        for inner in plan.inner_groups:
            plan.shard_inner(inner, data_parallel_size=mesh.size(), fully_shard=fully_shard,
                             **{k: v for k, v in kwargs.items() if k != "mesh"},
                             reshard_after_forward=False if (id(inner) in last and reshard is True) else reshard)
    for index, layer in enumerate(plan.layers):
        # The last layer's backward runs right after forward: resharding it would only re-gather it.
        last = index == len(plan.layers) - 1 and plan.in_forward_order
        fully_shard(layer, reshard_after_forward=False if (last and reshard is True) else reshard, **kwargs)
    if plan.embedding:
        embedding = plan.embedding[0] if len(plan.embedding) == 1 else None
        fully_shard(embedding if embedding is not None else plan.embedding, reshard_after_forward=reshard, **kwargs)
        if embedding is not None and _backward_reads_no_weight(embedding):
            # An embedding's weight gradient is built from the indices and the output gradient
            # alone (`embedding_dense_backward`), so its all-gather in backward is wasted: this
            # is the case `FSDPModule.set_unshard_in_backward` documents. Its gradient is still
            # reduce-scattered as usual.
            embedding.set_unshard_in_backward(False)
    if plan.head:
        # With tied weights the group is used first and last, so it must be freed after forward.
        head_reshard = reshard if plan.tied else (False if reshard is True else reshard)
        fully_shard(plan.head if len(plan.head) > 1 else plan.head[0], reshard_after_forward=head_reshard, **kwargs)
    fully_shard(model, reshard_after_forward=reshard, **kwargs)
    on_cpu = mesh.device_type == "cpu"
    if on_cpu:
        # Without CUDA streams FSDP2 all-gathers synchronously (`FSDPParamGroup.unshard_async_op`
        # is False), so a prefetch would only run earlier, not alongside compute. Issued
        # asynchronously, gloo moves the next layer's shards on its own thread while this layer
        # computes (torch 2.13 keeps the switch private: `FSDPModule._set_unshard_async_op`).
        set_async = getattr(model, "_set_unshard_async_op", None)
        if set_async is not None:
            set_async(True)
    _set_prefetch(plan, config, on_cpu)


def _backward_reads_no_weight(module: nn.Module) -> bool:
    """A plain `nn.Embedding` (its own forward, no adapter or wrapper inside) owning only its weight."""
    return (isinstance(module, nn.Embedding) and type(module).forward is nn.Embedding.forward
            and [name for name, _ in module.named_parameters()] == ["weight"])


def _set_prefetch(plan: ShardPlan, config: FSDP2Config, on_cpu: bool) -> None:
    layers = plan.layers
    forward = config.forward_prefetch if config.forward_prefetch is not None else (1 if on_cpu else 0)
    if not plan.in_forward_order:  # nested size-based groups: FSDP2's implicit order only
        return
    if forward:
        # Forward order of the groups: embedding, layers, [norm, head] (a tied group runs both
        # first and last, so it stays out of the chain).
        chain = ([plan.embedding[0]] if plan.embedding else []) + layers
        if plan.head and not plan.tied:
            chain.append(plan.head[0])  # any module of a list-form group stands for the group
        for i, group in enumerate(chain[:-1]):
            group.set_modules_to_forward_prefetch(chain[i + 1: i + 1 + forward])
    if config.backward_prefetch != 1:  # 1 is FSDP2's implicit default
        for i, layer in enumerate(layers):
            previous = layers[max(0, i - config.backward_prefetch): i][::-1]
            layer.set_modules_to_backward_prefetch(previous)


def materialize(parts: ModelParts, device: torch.device, *, init_weights: bool = True) -> None:
    """Allocate the local shards of a (partly) meta-device model, then run the model's own init.

    `to_empty` allocates only each rank's shard (the DTensors' local tensors) but also empties
    tensors that were real; their values (a partly loaded model's weights, buffers the constructor
    computed) are kept and put back. transformers' `_init_weights` fills the rest and recomputes
    non-persistent buffers such as rotary `inv_freq` (modeling_utils.PreTrainedModel._init_weights).
    """
    model = parts.model
    real = {name: local_tensor(t).detach().clone() for name, t in [*model.named_parameters(), *model.named_buffers()]
            if not local_tensor(t).is_meta}
    shared = _shared_parameter_names(model)
    model.to_empty(device=device)
    _retie(model, shared)
    with torch.no_grad():
        if init_weights:
            init_fn = getattr(parts.base, "_init_weights", None)
            packed = {id(w.module): w for w in quantized.weights(model).values()}
            for module in model.modules():
                if id(module) in packed:  # a quantized base's packed rows: no float init applies to them
                    _init_quantized_rows(packed[id(module)], init_fn)
                elif init_fn is not None:
                    init_fn(module)
                elif hasattr(module, "reset_parameters"):
                    module.reset_parameters()
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name in real:
                local_tensor(t).copy_(real[name])


def _init_quantized_rows(weight, init_fn) -> None:
    """A quantized layer on meta (a 4-bit model built from its config, as hf-fsdp2 simulate builds one) initialised
    as the model's own init draws the float layer, then quantized into this rank's rows: the init run on a float
    `nn.Linear` of the local rows (its bias copied to the layer's, which FSDP2 shards by the same rows). Collective
    for some formats (QuantizedWeight.load_rows): every rank reaches it in the same module order."""
    rows = local_tensor(weight.packed).shape[0]
    bias = getattr(weight.module, "bias", None)
    stand_in = nn.Linear(weight.in_features, rows, bias=bias is not None, dtype=weight.dtype,
                         device=local_tensor(weight.packed).device)
    if init_fn is not None:
        init_fn(stand_in)
    weight.load_rows(stand_in.weight)
    if bias is not None:
        local_tensor(bias).copy_(stand_in.bias)


def _shared_parameter_names(model: nn.Module) -> list[list[str]]:
    """Names of each parameter held by several modules (tied embeddings and any other sharing)."""
    by_id: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def _retie(model: nn.Module, shared: list[list[str]]) -> None:
    """`to_empty` from meta gives every module its own new parameter (a meta tensor cannot be swapped in
    place for a CPU one), so plain parameters that were shared stop being: each group is made one again.
    (FSDP2's sharded parameters keep their sharing: it materialises them itself.)"""
    for names in shared:
        first = model.get_parameter(names[0])
        for name in names[1:]:
            owner, _, attr = name.rpartition(".")
            module = model.get_submodule(owner) if owner else model
            if module._parameters.get(attr) is not first:
                upstream.set_entry(module, "_parameters", attr, first, "torch.nn.Module._parameters")


def _is_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in model.parameters()) or any(t.is_meta for t in model.buffers())


def adopt_if_sharded_at_load(parts: ModelParts, record: ShardedModel, config: FSDP2Config,
                             mesh: DeviceMesh | None) -> bool:
    """Take a model transformers sharded at load (`from_pretrained(distributed_config=...)`) as it is
    (sharding/adopt.py); False for any other model. `record`: the model's, made by the entry (no mesh
    unless hf_fsdp2 took the model already)."""
    if not (adopt.sharded_by_transformers(parts.model) and record.mesh is None):
        return False
    _adopt(parts, record, config, mesh)
    return True


def prepare_for_planning(model: nn.Module | ModelParts, *, to_device: bool = True,
                         record: ShardedModel | None = None) -> None:
    """What comes before the layout is planned: refusals, the model on the run's device (`to_device=False`:
    where it is, e.g. rank 0's weights that are broadcast from there), and quantized base weights in a row
    layout FSDP2 can shard (before the frozen-dtype cast, which would reinterpret packed bytes stored as
    floats, and before the planner costs them). `record`: the one the entry looked up for these parts.
    Idempotent."""
    parts = model if isinstance(model, ModelParts) else model_parts(model)  # an entry hands its parts
    model = parts.model
    record = record if record is not None else record_of(parts)
    # before the check below, which a PeftModel around a sharded model passes
    refuse_parameters_added_after(record, (name for name, _ in parts.base.named_parameters()),
                                  type(parts.base).__name__)
    if isinstance(model, FSDPModule) or replication.is_replicated(model):
        raise ValueError(f"{type(model).__name__} is already sharded; call `shard_model` once per model.")
    adopt.refuse_adapters_added_after(parts)
    quantized.refuse_unsupported(model)
    device = default_device()
    refuse_accelerator_model_on_host_backend({p.device.type for p in model.parameters()}, device)
    if to_device and not _is_meta(model) and device.type != "cpu":
        model.to(device)
    quantized.prepare(model)


def shard_planned(
    model: nn.Module | ModelParts,
    config: FSDP2Config,
    *,
    mesh: DeviceMesh | None = None,
    init_weights: bool = True,
    record: ShardedModel | None = None,
) -> nn.Module:
    """Shard a model `prepare_for_planning` prepared, with a layout already chosen (`config` has no
    `shard_size="auto"`: the planner resolved it; hf_fsdp2/shard.py joins the two), in place; returns it.

    Order: frozen dtype, activation checkpointing, regional compilation, then `fully_shard` per decoder
    layer (frozen base weights and LoRA adapters in one group), embedding group, [final norm, lm_head]
    group, root. A model on the meta device is sharded first and then only local shards are allocated
    and initialised by the model's own init (`init_weights=False` leaves them for a loader). `model`: the parts
    an entry made, with `record` the record it looked up (created), or a bare model, looked up here.

    Collective: call on every rank.
    """
    if config.is_auto_layout:
        raise ValueError("`shard_size`='auto' must be planned first: call hf_fsdp2.shard_model.")
    parts = model if isinstance(model, ModelParts) else model_parts(model)  # PEFT unwrapped once, by the entry
    model = parts.model
    if record is None:  # looked up once: what follows keeps its state in it
        record = record_of(parts, create=True)
    on_meta = _is_meta(model)
    device = default_device()
    mesh = mesh if mesh is not None else build_mesh(config)
    if TP_DIM in (mesh.mesh_dim_names or ()):
        # Before TP splits them: a TP DTensor parameter keeps its dtype through `param.data = ...to()`.
        apply_frozen_dtype(model, config.frozen_dtype)
    config = _tensor_parallel(parts, config, mesh, on_meta and init_weights)  # a loader fills meta weights (from_pretrained)
    config = _context_parallel_size(config, mesh)
    config = _sequence_parallel_size(config, mesh)
    plan = plan_groups(parts, config)
    if config.sp_size > 1:  # hooks before fully_shard's: FSDP2's own run around them
        sequence_parallel.apply_sequence_parallel(parts, config, mesh[SP_DIM], _ring_around_ulysses(config, mesh))
    if config.loss_tile_size is not None or config.mlp_tile_size is not None:
        sequence_tiling.apply_sequence_tiling(parts, plan.layers, config)
    if config.ep_size > 1:
        expert_parallel.refuse_unsupported(model, config, mesh)
        plan.inner_groups, experts_mesh = expert_parallel.apply_expert_parallel(parts, config, mesh)
        plan.shard_inner = functools.partial(expert_parallel.shard_experts, experts_mesh=experts_mesh)
    else:  # LoRA on whole fused experts inside the grouped matmuls, not folded into them each forward
        expert_parallel.apply_grouped_lora(parts)
        expert_parallel.apply_low_precision(parts, config, mesh.device_type)  # fp8_experts: the experts' matmuls
    if config.fp8:
        apply_fp8(model, plan)
    apply_frozen_dtype(model, config.frozen_dtype)
    if config.activation_checkpointing and config.compile != "model":  # compile="model": a graph pass
        plan.layers = apply_activation_checkpointing(model, plan.layers, config.checkpoint_every,
                                                     config.checkpoint_save_matmuls)
    if config.activation_offload:
        activation_offload.apply_activation_offload(plan.layers)
    if config.compile is True:
        compile_layers(plan.layers)
    if config.compile == "model" or any(is_compiled(layer) or isinstance(layer, CheckpointWrapper)
                                         for layer in plan.layers):
        disable_cache_in_training(parts)  # ours or Accelerate's checkpointing / regional compilation
    replicated = _replicate_or_shard(model, plan, config, mesh, record)
    if config.fp8 and mesh.device_type == "cpu":
        fp8.gather_float8_as_bytes(model)
    if on_meta:
        materialize(parts, torch.device("cpu") if config.cpu_offload else device, init_weights=init_weights)
    if replicated:  # DDP's reducer built now on every rank; rank 0's weights unless a loader fills them
        replication.synchronize(model, broadcast=init_weights or not on_meta)
    if config.fp8 and (init_weights or not on_meta):  # else the loader's weights come later: the
        fp8.precompute_scales(model)  # first all-gather then computes its scales itself
    if CP_DIM in (mesh.mesh_dim_names or ()) and mesh[CP_DIM].size() > 1 and config.sp_size == 1:
        context_parallel.enable_cpu_ring_attention()  # the training loop enters torch's context_parallel
        context_parallel.require_context_parallel(parts, mesh[CP_DIM].size())
    record.config, record.mesh, record.sharded_object = config, mesh, id(model)
    note_parameters(record, (name for name, _ in parts.base.named_parameters()))
    wrap_generate(model, record)  # each group gathered once per generate() call
    host_allocator.trim_if_returning()  # a CPU budget's plan: the unsharded weights' freed pages go back now
    return model


def _replicate_or_shard(model: nn.Module, plan: ShardPlan, config: FSDP2Config, mesh: DeviceMesh,
                        record: ShardedModel) -> bool:
    """One-rank shard groups train with DDP's reducer (sharding/replication.py) unless the config asks for
    FSDP2 or needs what only FSDP2 has; everything else with FSDP2, or, under compile="model", with the
    collectives in the compiled graph (sharding/compile/compiled_collectives.py). True when the model was replicated."""
    if config.compile == "model":
        checkpointed = (selective_checkpoint.checkpointed_layers(plan.layers, config.checkpoint_every)
                        if config.activation_checkpointing else [])
        # op-level selective checkpointing as the graph pass's tags: the ops whose outputs a checkpointed layer keeps
        kept_ops = selective_checkpoint.SAVED_OPS if config.checkpoint_save_matmuls else frozenset()
        compiled_collectives.apply(model, config, mesh, plan.ignored_params, plan.layers, checkpointed, record,
                                   kept_ops=kept_ops)
        return False
    if replication.mesh_trains_on_reducer(mesh, config):
        reasons = replication.fsdp_only_reasons(model, config)
        if not reasons:
            return replication.apply_replication(model, plan, config, mesh, record)
        if collectives.rank() == 0:
            logging.getLogger("hf_fsdp2").warning(
                "shard size 1: replicating with FSDP2 one-rank groups instead of DDP's reducer, for %s.",
                "; ".join(reasons))
    apply_fsdp(model, plan, config, data_parallel_mesh(mesh))
    return False


def keep_async_save(record: ShardedModel, async_save: bool) -> None:
    """A setting that does not change how the model is sharded, given once it was (Accelerate's settings at
    prepare: integrations/presharded.py): the record's config, which the engine writes, says it from now on."""
    record.config = record.config.replace(async_save=async_save)


def refuse_another_mesh(record: ShardedModel, wanted: FSDP2Config) -> None:
    """The mesh a model was sharded on cannot change once it was: the dimensions `wanted` (Accelerate's settings at
    prepare: integrations/presharded.py) asks of it must be the record's, else a ValueError naming them."""
    context_parallel.refuse_another_mesh(record.mesh, wanted.cp_size)


def _adopt(parts: ModelParts, record: ShardedModel, config: FSDP2Config, mesh: DeviceMesh | None) -> nn.Module:
    """Take a model transformers sharded at load as it is (sharding/adopt.py)."""
    model = parts.model
    config, model_mesh = adopt.adopted_config(model, config)
    if mesh is not None and mesh != model_mesh:
        raise ValueError(f"`mesh` {mesh} is not the mesh transformers sharded {type(model).__name__} on "
                         f"({model_mesh}); leave `mesh` out.")
    record.config, record.mesh, record.sharded_object = config, model_mesh, id(model)
    note_parameters(record, (name for name, _ in parts.base.named_parameters()))
    wrap_generate(model, record)
    if config.ep_size > 1:  # its experts' gradients on their own mesh, as ours (sharding/grad_clip.py)
        grad_clip.refuse_in_torch()
    return model


def _context_parallel_size(config: FSDP2Config, mesh: DeviceMesh) -> FSDP2Config:
    """The config's cp_size is the mesh's "cp" dimension (Accelerate's parallelism_config builds it)."""
    names = mesh.mesh_dim_names or ()
    cp = mesh[CP_DIM].size() if CP_DIM in names else 1
    if config.cp_size not in (1, cp):
        raise ValueError(no_cp_mesh(config.cp_size, mesh) if cp == 1 else
                         f"`cp_size`={config.cp_size} but the mesh's 'cp' dimension has {cp} ranks.")
    return config.replace(cp_size=cp) if config.cp_size != cp else config


def _ring_around_ulysses(config: FSDP2Config, mesh: DeviceMesh) -> sequence_parallel.Outer | None:
    """With cp_size and sp_size (hf_fsdp2.build_mesh's dp_shard x cp x sp): torch's ring attention over the cp ranks
    around Ulysses within each sp group (context_parallel.py's token order, attention and padding refusal, handed to
    sequence_parallel.py). Without torch's context_parallel: the batch is split by local_batch, the ring called on
    the attention's plain tensors."""
    if config.cp_size == 1:
        return None
    names = mesh.mesh_dim_names or ()
    if names.index(CP_DIM) + 1 != names.index(SP_DIM):
        raise ValueError(f"`sp_size`={config.sp_size} with `cp_size`={config.cp_size} needs the mesh's 'sp' dimension "
                         f"right after its 'cp' one (hf_fsdp2.build_mesh's), not {names}.")
    cp, sp = mesh[CP_DIM], mesh[SP_DIM]
    whole = flattened(mesh, (CP_DIM, SP_DIM))
    rank = whole.get_local_rank()
    if rank != cp.get_local_rank() * sp.size() + sp.get_local_rank():  # the order split_batch cuts the tokens in
        raise RuntimeError(f"the flattened cp x sp mesh numbers this rank {rank}, not cp rank x sp + sp rank.")
    size = cp.size()
    return sequence_parallel.Outer(
        whole.get_group(), rank, whole.size(),
        order=lambda length, device=None: context_parallel.load_balanced_order(length, size, device),
        attention=context_parallel.ring_attention(cp.get_group()),
        check=lambda mask: context_parallel.refuse_padding(mask, size), setting=f"cp_size={size}")


def _sequence_parallel_size(config: FSDP2Config, mesh: DeviceMesh) -> FSDP2Config:
    """The config's sp_size is the mesh's "sp" dimension (hf_fsdp2.build_mesh builds it from sp_size)."""
    names = mesh.mesh_dim_names or ()
    if config.sp_size > 1 and SP_DIM not in names and CP_DIM in names:  # Accelerate's parallelism_config's mesh
        raise ValueError(f"`sp_size`={config.sp_size} on a mesh with a 'cp' dimension but no 'sp' one "
                         f"({dict(zip(names, mesh.shape))}: Accelerate's parallelism_config cp_size): Ulysses within "
                         "ring context parallelism runs on hf_fsdp2.build_mesh(FSDP2Config(sp_size=..., cp_size=...))'s "
                         "dp_shard x cp x sp mesh, the batch split by hf_fsdp2.local_batch in a plain loop; under "
                         "Accelerate and the Trainer leave parallelism_config_cp_size at 1 and set hf_fsdp2's own "
                         "HF_FSDP2_CP_SIZE (or register(cp_size=...)) with HF_FSDP2_SP_SIZE: the prepared data loader "
                         "gives each cp x sp group the same rows and the training forward splits them. Accelerate's "
                         "maybe_context_parallel (which splits the batch for ring attention alone) is not done with it.")
    sp = _size_on_mesh(mesh, SP_DIM, "sp_size", config.sp_size)
    return config.replace(sp_size=sp) if config.sp_size != sp else config


def _size_on_mesh(mesh: DeviceMesh, dim: str, field: str, asked: int) -> int:
    """The size of the mesh's `dim` dimension (1 without one), refused by name where the config's `field` asked
    for another."""
    names = mesh.mesh_dim_names or ()
    size = mesh[dim].size() if dim in names else 1
    if asked not in (1, size):
        raise ValueError(f"`{field}`={asked} but the mesh {dict(zip(names, mesh.shape))} has "
                         f"{f'a {dim!r} dimension of {size}' if size > 1 else f'no {dim!r} dimension'}; build it "
                         "with hf_fsdp2.build_mesh(config).")
    return size


def _tensor_parallel(parts: ModelParts, config: FSDP2Config, mesh: DeviceMesh, on_meta: bool) -> FSDP2Config:
    """TP on the mesh's "tp" dimension (sharding/tensor_parallel.py), before FSDP2 shards the rest; the
    config's tp_size follows a mesh (or a model transformers split) that has one."""
    tp = _size_on_mesh(mesh, TP_DIM, "tp_size", config.tp_size)
    if tensor_parallel.is_tensor_parallel(parts.model) and tp == 1:
        raise ValueError("the model is already tensor-parallel (transformers split it): pass the mesh it was "
                         "split on (with its 'tp' dimension) as `mesh`.")
    if tp == 1:
        return config
    config = config.replace(tp_size=tp) if config.tp_size != tp else config
    tensor_parallel.refuse_unsupported(parts, config, on_meta)
    if not tensor_parallel.is_tensor_parallel(parts.model):
        tensor_parallel.apply_tensor_parallel(parts, mesh[TP_DIM])
    return config


def local_batch(batch: Mapping[str, Any], model: nn.Module) -> dict[str, Any]:
    """What this rank feeds `model` of a batch of whole sequences (its data-parallel rows): under `sp_size` > 1
    (sharding/sequence_parallel.py) input_ids, labels, attention_mask, position_ids cut along the sequence, with
    `position_ids`, `shift_labels` and `num_items_in_batch` added for the whole sequences first; the ranks of one
    sp group (neighbouring ranks: rank // sp_size is the data-parallel index under hf_fsdp2.build_mesh) pass the
    same batch. Otherwise the batch as it is. A model prepared by Accelerate (or the Trainer) splits the whole
    sequences in its training forward itself (sequence_parallel.split_in_forward): its batch is returned as it is."""
    parts = model_parts(model)  # an entry, called every micro-batch: PEFT unwrapped once
    record = record_of(parts)
    if record is None or record.mesh is None:
        raise ValueError("local_batch: the model is not sharded; call hf_fsdp2.shard_model first.")
    if SP_DIM not in (record.mesh.mesh_dim_names or ()) or sequence_parallel.splits_in_forward(parts):
        return dict(batch)
    return sequence_parallel.rank_batch(parts, batch)


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate gradients locally: no reduce-scatter (or HSDP all-reduce) inside the block.

    Run the accumulation micro-steps inside, the last micro-step outside.
    """
    if not (isinstance(model, FSDPModule) or replication.is_replicated(model)
            or compiled_collectives.is_traced(record_of(model))):
        raise TypeError(f"`no_sync` needs a model returned by `shard_model`, got {type(model).__name__}.")
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


# ---------------------------------------------------------------------------------------------
# Accelerate's prepare (integrations/accelerate.py): each technique's part, called from here so the integration
# names none. Accelerate's objects are read by duck type (sharding/ imports no integration).


def refuse_accelerate_settings(accelerator) -> None:
    """What Accelerate's own settings ask of a technique hf_fsdp2 does not run that way, refused by name where the
    model is prepared (the backend's config step): FP8 through a backend other than torchao's, then the
    accelerator's parallelism_config (`refuse_accelerate_parallelism`)."""
    fp8.refuse_accelerate_backend(accelerator)
    refuse_accelerate_parallelism(getattr(accelerator, "parallelism_config", None))


def refuse_accelerate_parallelism(parallelism_config) -> None:
    """hf_fsdp2 shards over (dp_replicate, dp_shard[, cp]) and applies TP on "tp": Accelerate's sequence-parallel
    size above 1 (DeepSpeed's Ulysses) is refused naming hf_fsdp2's own, and a CP backend other than torch's."""
    if parallelism_config is None:
        return
    sequence_parallel.refuse_accelerate_sp_size(parallelism_config)
    context_parallel.refuse_other_backend(parallelism_config)


def prepare_accelerator(accelerator, config: FSDP2Config) -> None:
    """Before Accelerate's prepare shards the model: under CP, the accelerator's context (`maybe_context_parallel`)
    refuses by name the sequence lengths the cp ranks cannot split evenly."""
    if config.cp_size > 1:
        context_parallel.check_accelerate_context(accelerator, config.cp_size)


def prepared_by_accelerate(model: nn.Module, parts: ModelParts, record: ShardedModel,
                           optimizers: list[torch.optim.Optimizer]) -> None:
    """After Accelerate's prepare: a model sharded here takes whole sequences from the loader under Ulysses (its
    training forward keeps this rank's slice, sequence_parallel.split_in_forward); FP8's scales are precomputed
    after every step of the prepared optimizers."""
    if sharded(record, id(model), parts.has_peft):
        sequence_parallel.split_in_forward(parts)
    if fp8.has_fp8(model):
        for optimizer in optimizers:
            fp8.attach_to_optimizer(model, optimizer)


def ranks_sharing_rows(config: FSDP2Config, is_fsdp2: bool = True) -> int:
    """How many neighbouring ranks load the same rows in a loop Accelerate prepares (1: each rank its own): an sp
    group under Ulysses, or with cp_size too (hf_fsdp2's own, not Accelerate's parallelism_config) a cp x sp group,
    whose model's training forward then splits them (`prepared_by_accelerate`); hf_fsdp2's mesh puts such a group's
    ranks side by side (runtime/distributed.build_mesh: dp_shard x cp x sp), so rank // n is a rank's data-parallel
    index. Refused by name where Accelerate does not hand the model to hf_fsdp2 (`is_fsdp2` False)."""
    sequence_parallel.refuse_without_fsdp2(config.sp_size, is_fsdp2)
    return config.sp_size * (config.cp_size if config.sp_size > 1 else 1)


def refuse_dispatched_rows(shared: int) -> None:
    """Accelerate's batch dispatcher gives each rank rows of its own: not the rows `shared` ranks must share."""
    sequence_parallel.refuse_dispatched_loader(shared)
