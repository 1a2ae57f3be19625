"""The sharding engine: activation checkpointing, then one `fully_shard` group per decoder layer,
an embedding group, a [final norm, lm_head] group and the root.

One small function per technique (torchtitan's `parallelize.py` is the model), called in order by
`shard_model`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    CheckpointWrapper,
    checkpoint_wrapper,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from .config import FSDP2Config
from .quantization import fp8
from .quantization.bnb_4bit import prepare_4bit_modules
from .runtime.distributed import build_mesh, default_device

# Prefix torch's CheckpointWrapper inserts into parameter names (checkpoint_wrapper.py: _CHECKPOINT_PREFIX).
_CHECKPOINT_PREFIX = "_checkpoint_wrapped_module."


def canonical_name(fqn: str) -> str:
    """A parameter name as the unwrapped model spells it (checkpoint-wrapper prefixes removed)."""
    return fqn.replace(_CHECKPOINT_PREFIX, "")


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The transformers model under a `PeftModel` (duck-typed so the engine needs no peft import)."""
    if hasattr(model, "peft_config") and hasattr(model, "get_base_model"):
        return model.get_base_model()
    return model


# ---------------------------------------------------------------------------------------------
# Finding the groups


@dataclass
class ShardPlan:
    """Which modules become which `fully_shard` group (computed before any module is wrapped)."""

    layers: list[nn.Module]
    embedding: list[nn.Module] | None  # the input embedding (and modules sharing its weight)
    head: list[nn.Module]  # [final norm, lm_head]; with tied embeddings also the embedding
    tied: bool
    in_forward_order: bool = True  # layers are a flat stack run one after another (prefetch chains)
    ignored_params: set = dataclasses.field(default_factory=set)  # kept out of FSDP (`ignored_modules`)


def resolve_layer_class_names(model: nn.Module, config: FSDP2Config) -> tuple[str, ...]:
    """The configured class names, or the model's `_no_split_modules`; checked against the model.

    `_no_split_modules` also lists blocks that must merely stay whole (`BertEmbeddings`,
    `ViTEmbeddings`, a vision tower's patch embedding): only classes repeated in a stack (inside an
    `nn.ModuleList`) become layer groups; the rest stay in the group that holds them."""
    names = config.layer_cls_names
    from_model = names is None
    if from_model:
        # Without `_no_split_modules` (BERT before transformers 5.1, custom models): the blocks stacked
        # in an nn.ModuleList that hold modules of their own (a stack of bare Linears is no layer).
        names = tuple(getattr(unwrap_peft(model), "_no_split_modules", None) or ()) or tuple(
            sorted(_stacked_class_names(model, composite=True)))
        if not names:
            raise ValueError(
                f"`layer_cls_names` is not set and {type(unwrap_peft(model)).__name__} has no "
                f"`_no_split_modules`; set `layer_cls_names` to the decoder layer class "
                f"(one of: {', '.join(_module_class_names(model))}), or `wrap_policy`='none'."
            )
        names = tuple(n for n in names if n in _stacked_class_names(model)) or names
    present = set(_module_class_names(model))
    missing = [n for n in names if n not in present]
    if missing and len(missing) == len(names):
        raise ValueError(
            f"`layer_cls_names`={list(names)} matches no module of {type(model).__name__}. "
            f"The model contains these module classes: {', '.join(sorted(present))}."
        )
    return tuple(n for n in names if n in present)


def _stacked_class_names(model: nn.Module, composite: bool = False) -> set[str]:
    """Class names of modules that sit in an `nn.ModuleList` (a stack of layers); with `composite`,
    only those that contain submodules with parameters."""
    names = set()
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            for child in module:
                inner = child._checkpoint_wrapped_module if isinstance(child, CheckpointWrapper) else child
                if not composite or any(_has_params(c) for c in inner.children()):
                    names.add(type(inner).__name__)
    return names


def _module_class_names(model: nn.Module) -> list[str]:
    return sorted({type(m).__name__ for m in model.modules() if not isinstance(m, CheckpointWrapper)})


def find_layers(model: nn.Module, class_names: tuple[str, ...]) -> list[nn.Module]:
    """Modules whose class name matches, in forward (registration) order; a match's own
    submodules are not searched, so nested matches stay in their outer group.

    A layer inside a `CheckpointWrapper` is represented by the wrapper, which is what its parent calls.
    """
    layers: list[nn.Module] = []

    def walk(module: nn.Module) -> None:
        for child in module.children():
            inner = child._checkpoint_wrapped_module if isinstance(child, CheckpointWrapper) else child
            if type(inner).__name__ in class_names:
                layers.append(child)
            else:
                walk(child)

    walk(model)
    return layers


def _find_final_norm(model: nn.Module, layers: list[nn.Module]) -> nn.Module | None:
    """The norm that follows the last layer stack (the one feeding the output head): a *Norm child of
    the module holding that stack's list, not one applied to embeddings (`layernorm_embedding`).

    With several stacks (encoder-decoder, a vision tower before a language model) the last one in
    module order is the decoder / language model. Found structurally, so it also works under a
    PeftModel (where Accelerate's lookup misses it). Other stacks' norms stay in the root group.
    """
    layer_ids = {id(layer) for layer in layers}
    final = None
    for owner in model.modules():
        if any(isinstance(c, nn.ModuleList) and any(id(m) in layer_ids for m in c) for c in owner.children()):
            norms = [c for name, c in owner.named_children()
                     if "norm" in type(c).__name__.lower() and "emb" not in name.lower()]
            final = norms[-1] if norms else None
    return final


def ignored_parameters(model: nn.Module, pattern: str | None) -> set:
    """Parameters of the modules whose full name matches `pattern` (Accelerate's `fsdp_ignored_modules`
    semantics: `re.fullmatch` on `named_modules()` names); a pattern matching nothing is an error."""
    if pattern is None:
        return set()
    regex = re.compile(pattern)
    matched = [module for name, module in model.named_modules() if name and regex.fullmatch(name)]
    if not matched:
        names = [name for name, _ in model.named_modules() if name][:12]
        raise ValueError(f"`ignored_modules`={pattern!r} matches no module of {type(model).__name__} "
                         f"(module names look like: {', '.join(names)}, ...).")
    return {p for module in matched for p in module.parameters()}


def size_based_groups(model: nn.Module, min_num_params: int, ignored: set) -> list[nn.Module]:
    """Accelerate's SIZE_BASED_WRAP for FSDP2: every module below the root with more than
    `min_num_params` parameters, children before parents. A module is skipped when a parameter of
    its own is also reached from outside it (a tied or shared weight), so no weight is in two groups."""
    owners: dict[int, set[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), set()).add(name.rpartition(".")[0])
    groups = []
    for name, module in reversed(list(model.named_modules())):
        if not name or isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            continue
        params = [p for p in module.parameters() if p not in ignored]
        if sum(p.numel() for p in params) <= min_num_params:
            continue
        inside = lambda owner: owner == name or owner.startswith(name + ".")  # noqa: E731
        if all(inside(o) for p in params for o in owners[id(p)]):
            groups.append(module)
    return groups


def plan_groups(model: nn.Module, config: FSDP2Config) -> ShardPlan:
    ignored = ignored_parameters(model, config.ignored_modules)
    if config.wrap_policy == "none":
        return ShardPlan(layers=[], embedding=None, head=[], tied=False, ignored_params=ignored)
    if config.wrap_policy == "size":
        return ShardPlan(layers=size_based_groups(model, config.min_num_params, ignored), embedding=None, head=[],
                         tied=False, in_forward_order=False, ignored_params=ignored)
    layers = find_layers(model, resolve_layer_class_names(model, config))
    base = unwrap_peft(model)
    embedding = base.get_input_embeddings() if hasattr(base, "get_input_embeddings") else None
    lm_head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    norm = _find_final_norm(model, layers)
    tied = (
        embedding is not None
        and lm_head is not None
        and getattr(lm_head, "weight", None) is not None
        and lm_head.weight is embedding.weight
    )
    head = [m for m in (norm, lm_head) if m is not None and _has_params(m)]
    if tied:
        # A parameter may live in one group only: the tied weight's group holds embedding, norm and head.
        head = [embedding, *[m for m in head if m is not embedding]]
        embedding = None
    plan = ShardPlan(layers=layers, embedding=[embedding] if embedding is not None and _has_params(embedding) else None,
                     head=head, tied=tied, ignored_params=ignored)
    resolve_shared_parameters(model, plan)
    return plan


def resolve_shared_parameters(model: nn.Module, plan: ShardPlan) -> None:
    """No parameter may be in two `fully_shard` groups, and a group must hold every module that uses
    one of its parameters (else that module keeps the unsharded tensor). Shared parameters are found
    by identity: an encoder-decoder's embedding reused by encoder and decoder, a masked LM's decoder
    bias tied to its prediction head, any weight tied across modules. A module outside every group
    that owns such a parameter joins the group (BART's encoder/decoder `embed_tokens` join the shared
    embedding's group); where that cannot be (it is the root, or it holds a module of any group, as
    BERT's `cls.predictions` holds the tied `decoder`), the group dissolves into the root group,
    which may hold shared parameters. Repeated until nothing changes."""
    owners: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), []).append(module)
    while True:
        groups = ([plan.embedding] if plan.embedding else []) + ([plan.head] if plan.head else []) + [
            [layer] for layer in plan.layers]
        covered = [{id(m) for top in group for m in top.modules()} for group in groups]
        for index, group in enumerate(groups):
            outside = _outside_owners(model, group, covered[index], covered, owners)
            if outside == []:
                continue
            is_layer = index >= len(groups) - len(plan.layers)
            if outside is not None and not is_layer:  # a layer stays one module: it dissolves instead
                group.extend(outside)
            elif group is plan.embedding:
                plan.embedding = None
            elif group is plan.head:
                plan.head, plan.tied = [], False
            else:
                plan.layers = [layer for layer in plan.layers if layer is not group[0]]
            break
        else:
            return


def _outside_owners(model: nn.Module, group: list[nn.Module], mine: set[int], covered: list[set[int]],
                    owners: dict[int, list[nn.Module]]) -> list[nn.Module] | None:
    """Modules outside every group that own one of `group`'s parameters; None when one cannot join
    it: it is the root, or it is (or holds) a module of any group, this one's other members included."""
    outside: list[nn.Module] = []
    for pid in {id(p) for top in group for p in top.parameters()}:
        for owner in owners.get(pid, []):
            if id(owner) in mine:
                continue
            if owner is model or any(id(m) in c for m in owner.modules() for c in covered):
                return None
            if all(owner is not o for o in outside):
                outside.append(owner)
    return outside


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


# ---------------------------------------------------------------------------------------------
# Techniques, applied in order


def apply_frozen_dtype(model: nn.Module, dtype: torch.dtype | None) -> None:
    """Store frozen parameters in `dtype` (e.g. bf16 base weights under fp32 LoRA)."""
    if dtype is None:
        return
    for param in model.parameters():
        if not param.requires_grad and param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)


def apply_fp8(model: nn.Module, plan: ShardPlan) -> fp8.Fp8Conversion:
    """The decoder layers' linears to torchao Float8Linear with FP8 all-gather; what was kept and why
    is logged on rank 0 and kept on the model (`_hf_fsdp2_fp8`)."""
    conversion = fp8.convert(model, plan.layers)
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        logging.getLogger("hf_fsdp2").warning(conversion.summary())
    model._hf_fsdp2_fp8 = conversion
    return conversion


def apply_activation_checkpointing(model: nn.Module, layers: list[nn.Module]) -> list[nn.Module]:
    """Wrap each layer in torch's non-reentrant `CheckpointWrapper`, in place; returns the wrappers.

    Applied before `fully_shard` so each wrapper becomes the group: FSDP's unshard happens outside
    the checkpointed region and again, through its pre-backward hook, for the recomputation.
    """
    # A KV cache filled in the forward is filled again by the recomputation (transformers 5.0 then fails
    # torch's metadata check); transformers' own gradient checkpointing turns the cache off the same way.
    config = getattr(unwrap_peft(model), "config", None)
    for cfg in (config, getattr(config, "get_text_config", lambda: None)()):  # a multimodal model's text config too
        if getattr(cfg, "use_cache", False):
            cfg.use_cache = False
    wrapped: list[nn.Module] = []
    for layer in layers:
        if isinstance(layer, CheckpointWrapper):
            wrapped.append(layer)
            continue
        parent, name = _parent_of(model, layer)
        wrapper = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
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
    if plan.ignored_params:
        kwargs["ignored_params"] = plan.ignored_params
    reshard = config.reshard_after_forward
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


def materialize(model: nn.Module, device: torch.device, *, init_weights: bool = True) -> None:
    """Allocate the local shards of a (partly) meta-device model, then run the model's own init.

    `to_empty` allocates only each rank's shard (the DTensors' local tensors) but also empties
    tensors that were real; their values (a partly loaded model's weights, buffers the constructor
    computed) are kept and put back. transformers' `_init_weights` fills the rest and recomputes
    non-persistent buffers such as rotary `inv_freq` (modeling_utils.PreTrainedModel._init_weights).
    """
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    real = {name: local(t).detach().clone() for name, t in [*model.named_parameters(), *model.named_buffers()]
            if not local(t).is_meta}
    model.to_empty(device=device)
    with torch.no_grad():
        if init_weights:
            base = unwrap_peft(model)
            init_fn = getattr(base, "_init_weights", None)
            for module in model.modules():
                if init_fn is not None:
                    init_fn(module)
                elif hasattr(module, "reset_parameters"):
                    module.reset_parameters()
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name in real:
                local(t).copy_(real[name])


def _is_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in model.parameters()) or any(t.is_meta for t in model.buffers())


def shard_model(
    model: nn.Module,
    config: FSDP2Config | None = None,
    *,
    mesh: DeviceMesh | None = None,
    init_weights: bool = True,
) -> nn.Module:
    """Shard a Hugging Face model (or a `PeftModel`) with FSDP2, in place; returns it.

    Order: frozen dtype, activation checkpointing, then `fully_shard` per decoder layer (frozen base
    weights and LoRA adapters in one group), embedding group, [final norm, lm_head] group, root.
    A model on the meta device is sharded first and then only local shards are allocated and
    initialised by the model's own init (`init_weights=False` leaves them for a loader).

    Collective: call on every rank.
    """
    config = config or FSDP2Config()
    mesh = mesh if mesh is not None else build_mesh(config)
    if isinstance(model, FSDPModule):
        raise ValueError(f"{type(model).__name__} is already sharded; call `shard_model` once per model.")
    on_meta = _is_meta(model)
    device = default_device()
    if not on_meta and device.type != "cpu":
        model.to(device)
    # 4-bit base weights get a row layout FSDP2 can shard (before the frozen-dtype cast, which
    # would reinterpret packed bytes stored as floats).
    prepare_4bit_modules(model)
    plan = plan_groups(model, config)
    if config.fp8:
        apply_fp8(model, plan)
    apply_frozen_dtype(model, config.frozen_dtype)
    if config.activation_checkpointing:
        plan.layers = apply_activation_checkpointing(model, plan.layers)
    apply_fsdp(model, plan, config, mesh)
    if config.fp8 and mesh.device_type == "cpu":
        fp8.gather_float8_as_bytes(model)
    if on_meta:
        materialize(model, torch.device("cpu") if config.cpu_offload else device, init_weights=init_weights)
    if config.fp8 and (init_weights or not on_meta):  # else the loader's weights come later: the
        fp8.precompute_scales(model)  # first all-gather then computes its scales itself
    model._hf_fsdp2_config = config  # read by the checkpoint code: mesh, dtypes
    model._hf_fsdp2_mesh = mesh
    return model


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate gradients locally: no reduce-scatter (or HSDP all-reduce) inside the block.

    Run the accumulation micro-steps inside, the last micro-step outside.
    """
    if not isinstance(model, FSDPModule):
        raise TypeError(f"`no_sync` needs a model returned by `shard_model`, got {type(model).__name__}.")
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
