"""Which modules become which `fully_shard` group, decided before anything is wrapped: each decoder
layer, the input embedding, [final norm, lm_head] and the root; shared weights never in two groups.

Pure: no process group, no allocation; the engine, the memory estimate and the layout planner all
read the same `ShardPlan`.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from ..config import FSDP2Config
from .model_parts import ModelParts

# Prefix torch's CheckpointWrapper inserts into parameter names (checkpoint_wrapper.py: _CHECKPOINT_PREFIX).
_CHECKPOINT_PREFIX = "_checkpoint_wrapped_module."


def canonical_name(fqn: str) -> str:
    """A parameter name as the unwrapped model spells it (checkpoint-wrapper prefixes removed)."""
    return fqn.replace(_CHECKPOINT_PREFIX, "")


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
    # Modules inside the layers that are FSDP2 groups of their own, sharded before their layers by the function the
    # technique that made them hands along, `shard_inner(module, data_parallel_size=, fully_shard=, **kwargs)`
    # (sharding/engine.py; expert parallelism's experts on their own mesh)
    inner_groups: list = dataclasses.field(default_factory=list)
    shard_inner: Callable | None = None


def resolve_layer_class_names(parts: ModelParts, config: FSDP2Config) -> tuple[str, ...]:
    """The configured class names, or the model's `_no_split_modules`; checked against the model.

    `_no_split_modules` also lists blocks that must merely stay whole (`BertEmbeddings`,
    `ViTEmbeddings`, a vision tower's patch embedding): only classes repeated in a stack (inside an
    `nn.ModuleList`) become layer groups; the rest stay in the group that holds them. `parts`: the model
    unwrapped where it came in (sharding/model_parts.py)."""
    model = parts.model
    names = config.layer_cls_names
    from_model = names is None
    if from_model:
        # Without `_no_split_modules` (BERT before transformers 5.1, custom models): the blocks stacked
        # in an nn.ModuleList that hold modules of their own (a stack of bare Linears is no layer).
        names = tuple(getattr(parts.base, "_no_split_modules", None) or ()) or tuple(
            sorted(_stacked_class_names(model, composite=True)))
        if not names:
            raise ValueError(
                f"`layer_cls_names` is not set and {type(parts.base).__name__} has no "
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


def ignored_modules(model: nn.Module, pattern: str | None) -> list[nn.Module]:
    """The modules whose full name matches `pattern` (Accelerate's `fsdp_ignored_modules` semantics:
    `re.fullmatch` on `named_modules()` names); a pattern matching nothing is an error."""
    if pattern is None:
        return []
    regex = re.compile(pattern)
    matched = [module for name, module in model.named_modules() if name and regex.fullmatch(name)]
    if not matched:
        names = [name for name, _ in model.named_modules() if name][:12]
        raise ValueError(f"`ignored_modules`={pattern!r} matches no module of {type(model).__name__} "
                         f"(module names look like: {', '.join(names)}, ...).")
    return matched


def ignored_parameters(model: nn.Module, pattern: str | None) -> set:
    """Parameters of the `ignored_modules`: left out of FSDP (replicated, gradients not reduced)."""
    return {p for module in ignored_modules(model, pattern) for p in module.parameters()}


def replicated_frozen_parameters(model: nn.Module, config: FSDP2Config, shard_size: int) -> set:
    """Frozen weights FSDP2 need not manage: with a shard group of one rank (replication, S=1) a frozen
    parameter is a full copy on every rank either way, has no gradient to reduce, and under FSDP2 would
    only be copied into an "all-gathered" buffer every step. Kept out of FSDP (as `ignored_params`)
    they are used in place, as DDP uses them. Only floating weights already in the compute dtype (else
    FSDP2's cast would be lost). Callers leave it out where a technique needs FSDP2 to gather every weight (the
    engine and the estimate: FP8, whose weights FSDP2 gathers in float8)."""
    if shard_size != 1:
        return set()
    return {p for p in model.parameters() if not p.requires_grad and p.is_floating_point()
            and (config.param_dtype is None or p.dtype == config.param_dtype)}


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


def plan_groups(parts: ModelParts, config: FSDP2Config) -> ShardPlan:
    """The groups `shard_planned` makes of the model (`parts`: unwrapped where it came in: the engine, the
    planner's meta model)."""
    model = parts.model
    ignored = ignored_parameters(model, config.ignored_modules)
    if config.wrap_policy == "none":
        return ShardPlan(layers=[], embedding=None, head=[], tied=False, ignored_params=ignored)
    if config.wrap_policy == "size":
        return ShardPlan(layers=size_based_groups(model, config.min_num_params, ignored), embedding=None, head=[],
                         tied=False, in_forward_order=False, ignored_params=ignored)
    layers = find_layers(model, resolve_layer_class_names(parts, config))
    base = parts.base
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



def apply_frozen_dtype(model: nn.Module, dtype: torch.dtype | None) -> None:
    """Store frozen parameters in `dtype` (e.g. bf16 base weights under fp32 LoRA)."""
    if dtype is None:
        return
    for param in model.parameters():
        if not param.requires_grad and param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)

