"""Mixed precision on DDP's reducer: each group's parameters cast to `param_dtype` for its forward, as
FSDP2's `MixedPrecisionPolicy` casts them when it all-gathers.

Why not torch's own: DDP's `_MixedPrecision` swaps the parameters of the module DDP wraps, which under
composable `replicate` is a ParameterList that never runs forward; `torch.autocast` is not FSDP2's
numerics (it keeps fp32 for the ops it lists and casts per op, not per parameter). So this does what
FSDP2 does, on the same groups (sharding/groups.py's plan: each decoder layer, the embedding, the
[norm, head] modules, the root): at a group's forward its floating-point inputs are cast to
`param_dtype` (FSDP2's `cast_forward_inputs`) and each floating parameter of another dtype is read,
for that forward only, as a cast copy: the cast tensor is set in the owning module's instance `__dict__`,
which attribute lookup finds before `nn.Module.__getattr__` reaches `_parameters`. The parameters
themselves stay fp32 leaves, so `named_parameters()`, `state_dict()`, the optimizer and DDP's reducer
see what they saw; gradients flow back through the cast into the fp32 leaf (the reduce is in fp32, as
FSDP2's default `reduce_dtype` here). A checkpointed layer casts inside the checkpoint, so its
recomputation casts again (the copies are not kept alive until backward). Inside `generate()` the
casts are made once for the call (`cast_once`), not once per token.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.utils._pytree import tree_map

from ..runtime import upstream
from .groups import ShardPlan
from .record import ShardedModel

# A parameter's cast copy in its module's instance dict shadows it for one forward.
_SHADOW = "torch.nn.Module.__dict__"


class _CastState:
    def __init__(self, dtype: torch.dtype, entries: list[tuple[nn.Module, str, nn.Parameter]]):
        self.dtype = dtype
        self.entries = entries  # every group's (owning module, name, parameter), for cast_once
        self.held = False  # inside cast_once: the copies stay set, the hooks do nothing


def needs_cast(param: torch.Tensor, dtype: torch.dtype | None) -> bool:
    """FSDP2's rule (`FSDPParam.init_dtype_attrs`): floating parameters of another dtype are cast."""
    return dtype is not None and param.is_floating_point() and param.dtype != dtype


def apply_compute_cast(model: nn.Module, plan: ShardPlan, dtype: torch.dtype | None, record: ShardedModel,
                       ignored: list[nn.Module] = ()) -> bool:
    """Cast `model`'s groups to `dtype` for compute, the casts kept in its `record` (for `cast_once`); False
    (nothing registered) when no parameter needs it."""
    if dtype is None or not any(needs_cast(p, dtype) for p in model.parameters()):
        return False
    members = [*plan.layers, *(plan.embedding or []), *plan.head]
    skipped = {id(p) for module in ignored for p in module.parameters()}
    hooked: list[tuple[nn.Module, list]] = []
    for module in [*members, model]:
        # The parameters of the modules this group manages (a tied weight owned by two modules is cast
        # by each at its own forward; gradients meet at the fp32 leaf).
        entries = [(owner, name, param) for owner in _modules_of_group(module, members, ignored)
                   for name, param in owner.named_parameters(recurse=False)
                   if needs_cast(param, dtype) and id(param) not in skipped]
        hooked.append((module, entries))
    state = _CastState(dtype, [entry for _, entries in hooked for entry in entries])
    record.compute_cast = state
    for module, entries in hooked:
        module.register_forward_pre_hook(_cast_inputs(state), with_kwargs=True, prepend=True)
        # A checkpoint wrapper's inner module runs again in backward: its casts are made there.
        inner = module._checkpoint_wrapped_module if isinstance(module, CheckpointWrapper) else module
        inner.register_forward_pre_hook(_set_casts(state, entries))
        inner.register_forward_hook(_drop_casts(state, entries), always_call=True)
    return True


@contextlib.contextmanager
def cast_once(record: ShardedModel) -> Iterator[None]:
    """Every group's cast copies made once and kept for the block (generate()), then dropped."""
    state: _CastState | None = record.compute_cast
    if state is None or state.held:
        yield
        return
    with torch.no_grad():
        _set(state.entries, state.dtype)
    state.held = True
    try:
        yield
    finally:
        state.held = False
        _drop(state.entries)


def _modules_of_group(module: nn.Module, group_roots: list[nn.Module], ignored) -> Iterator[nn.Module]:
    """`module` and its descendants, without other groups' subtrees or ignored modules (FSDP2's managed
    modules, `_get_managed_modules`)."""
    stop = {id(m) for m in [*group_roots, *ignored]} - {id(module)}
    stack = [module]
    while stack:
        current = stack.pop()
        yield current
        stack.extend(child for child in current.children() if id(child) not in stop)


def _cast_tensor(dtype: torch.dtype, x):
    return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype else x


def _cast_inputs(state: _CastState):
    @torch._dynamo.disable  # as FSDP2's hooks: outside a compiled layer's graph
    def hook(module: nn.Module, args: tuple, kwargs: dict):
        cast = lambda x: _cast_tensor(state.dtype, x)  # noqa: E731
        return tree_map(cast, args), tree_map(cast, kwargs)

    return hook


def _set_casts(state: _CastState, entries):
    @torch._dynamo.disable
    def hook(module: nn.Module, args: tuple) -> None:
        if not state.held:
            _set(entries, state.dtype)

    return hook


def _drop_casts(state: _CastState, entries):
    @torch._dynamo.disable
    def hook(module: nn.Module, args: tuple, output) -> None:
        if not state.held:
            _drop(entries)

    return hook


def _set(entries, dtype: torch.dtype) -> None:
    for owner, name, param in entries:
        upstream.set_entry(owner, "__dict__", name, param.to(dtype), _SHADOW)


def _drop(entries) -> None:
    for owner, name, _ in entries:
        upstream.del_entry(owner, "__dict__", name, _SHADOW)


__all__ = ["apply_compute_cast", "cast_once", "needs_cast"]
