"""Generation on a sharded model: each group gathered once per `generate()` call, not once per token.

FSDP2 reshards a group after its forward, so autoregressive decoding all-gathers every group again
for every new token (a 512-token completion on 32 layers: ~17,000 all-gathers). DeepSpeed ZeRO-3 under
TRL gathers once per generate call (`ds3_gather_for_generation`). Here, inside `generate()`, the groups
are told not to reshard after forward (`FSDPModule.set_reshard_after_forward(False)`): the first
token's forward gathers each group, the rest of the call reuses them, and the groups are resharded
(and their own setting restored) when it returns. What is kept is bounded by memory: groups in
execution order while their gathered bytes fit in a fraction of the memory free now (agreed over
ranks: every rank must gather the same groups); the rest gather per token as before. When every
group is kept, transformers' per-token end-of-sequence all-reduce (`synced_gpus`) is turned off
unless the caller set it: nothing collective is left in the decoding loop, so a rank whose sequences
end first returns while the others go on. Under expert parallelism every forward exchanges tokens between
ranks, so `synced_gpus` is turned on instead (every rank steps until all are done; `synced_gpus=False` is
refused by name).

`shard_model` wraps the model instance's `generate` (runtime/upstream.py seam
`GenerationMixin.generate`), so transformers' `generate`, TRL's `unwrap_model_for_generation` (which
calls `generate` on the model under FSDP2) and the Trainer's `predict_with_generate` all reach it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from typing import Iterator

import torch
import torch.nn as nn

from ..runtime import collectives, fsdp_state, upstream
from ..runtime.distributed import reshard
from . import compute_cast
from .record import ShardedModel

FREE_MEMORY_FRACTION = 0.5  # of the memory free at generate(): the rest is the KV cache's and activations'
_SEAM = "transformers.generation.utils.GenerationMixin.generate"
_FSDP_STATE = "torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState"
_HOOK_HANDLE = f"{_FSDP_STATE}._pre_forward_hook_handle"  # FSDP2's hooks swapped in the module's hook dicts


def wrap_generate(model: nn.Module, record: ShardedModel) -> None:
    """Make `model.generate(...)` gather each group once per call (no-op for models without generate); `record`:
    the model's, read at each call."""
    if callable(getattr(model, "generate", None)):
        upstream.wrap_instance_method(model, "generate", _SEAM, lambda original: _generate(model, record, original))


def _generate(model: nn.Module, record: ShardedModel, original):
    @functools.wraps(original)
    def generate(*args, **kwargs):
        exchanges = record.config.forward_exchanges() if record.config is not None else None
        if exchanges:  # before anything collective: a refusal leaves every rank where it was
            kwargs["synced_gpus"] = _synced_for_exchanges(kwargs.get("synced_gpus"), exchanges)
        with gathered_for_generation(model, record) as kept, compute_cast.cast_once(record), \
                _traced_kept(model, record) as traced:
            if kwargs.get("synced_gpus") is None and len(kept) == len(_groups(model)) and traced is not False:
                # transformers turns `synced_gpus` on for FSDP models (generation/utils.py: it checks
                # is_fsdp_managed_module) so that ranks keep stepping together through per-token
                # all-gathers: one all-reduce of an "I'm done" flag per token, and every rank waits for
                # the slowest. With every group kept gathered, decoding issues no collective after the
                # first forward, so each rank stops when its own sequences end.
                kwargs["synced_gpus"] = False
            return original(*args, **kwargs)
    return generate


def _synced_for_exchanges(synced_gpus: bool | None, exchanges: str) -> bool:
    """Every forward exchanges data with ranks that hold other batches (`exchanges`: what does, as
    FSDP2Config.forward_exchanges names it), so every rank must run as many forwards as the slowest. That is
    transformers' `synced_gpus=True` (generation/utils.py `_has_unfinished_sequences`: a rank whose sequences
    ended keeps running forwards, its tokens not appended, until an all-reduce says every rank is done); each
    rank's tokens are those it would decode alone."""
    if synced_gpus is False:
        raise ValueError(f"`synced_gpus`=False with {exchanges}: a rank whose sequences end first would stop joining "
                         "the exchanges of the other ranks' forwards and they would wait forever; leave `synced_gpus` "
                         "unset (hf_fsdp2 sets it to True for this model).")
    return True


@contextlib.contextmanager
def _traced_kept(model: nn.Module, record: ShardedModel) -> Iterator[bool | None]:
    """A model whose parameters are gathered where they are used (the record holds their `gather`:
    sharding/compile/compiled_collectives.py): every parameter gathered once per generate() call when the whole
    model fits FREE_MEMORY_FRACTION of the free memory (smallest over ranks); yields whether it does (None for other
    models). Collective for those models: every rank calls generate()."""
    if record.gather is None:
        yield None
        return
    with record.gather.gathered_once(model, _generation_budget(model)) as kept:
        yield kept


def _groups(model: nn.Module) -> list[nn.Module]:
    """One module per FSDP group, in module order (a group of several modules, like [norm, lm_head],
    shares one state: it appears once)."""
    from torch.distributed.fsdp import FSDPModule

    seen, out = set(), []
    for module in model.modules():
        if isinstance(module, FSDPModule) and id(module._get_fsdp_state()) not in seen:
            seen.add(id(module._get_fsdp_state()))
            out.append(module)
    return out


def _gathered_bytes(group: nn.Module) -> int:
    """A group's parameters unsharded, in the dtype they compute in (FSDP2's param_dtype, else their own)."""
    # FSDP2 gathers floating-point parameters in the policy's param_dtype, others as they are
    # (torch/distributed/fsdp/_fully_shard/_fsdp_param.py: init_dtype_attrs).
    total = 0
    for param_group in fsdp_state.param_groups(group._get_fsdp_state()):
        for fsdp_param in param_group.fsdp_params:
            dtype = fsdp_param.sharded_param.dtype  # orig_dtype is set only at lazy init
            if dtype.is_floating_point and param_group.mp_policy.param_dtype is not None:
                dtype = param_group.mp_policy.param_dtype
            total += fsdp_param._orig_size.numel() * dtype.itemsize
    return total


def free_memory(device: torch.device) -> int:
    """Bytes free on `device` now (for the CPU: MemAvailable shared by the local ranks)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    if available is None:
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    from ..runtime.distributed import local_world_size  # validated: a garbage LOCAL_WORLD_SIZE is a clear error

    return available // local_world_size(collectives.world_size())


def _generation_budget(model: nn.Module) -> int:
    """FREE_MEMORY_FRACTION of the memory free on the model's device, the smallest over ranks (collective)."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    return collectives.all_reduce_int(int(free_memory(device) * FREE_MEMORY_FRACTION), "min")


def groups_to_keep(model: nn.Module, budget: int | None = None) -> list[nn.Module]:
    """The groups kept gathered during generate(): in execution order (module order), while they fit
    `budget` (default: FREE_MEMORY_FRACTION of the free memory, the smallest over ranks).
    Collective without `budget`: call on every rank."""
    groups = _groups(model)
    if not groups:
        return []
    if budget is None:
        budget = _generation_budget(model)
    order = groups[1:] + groups[:1]  # the root group (the model itself) runs around the layers: last priority
    kept, used = [], 0
    for group in order:
        size = _gathered_bytes(group)
        if used + size > budget:
            break
        kept.append(group)
        used += size
    return kept


@contextlib.contextmanager
def gathered_for_generation(model: nn.Module, record: ShardedModel, budget: int | None = None
                            ) -> Iterator[list[nn.Module]]:
    """Inside the block, the groups `groups_to_keep` picks stay gathered after their first forward;
    on exit every group is resharded and its own `reshard_after_forward` restored. Re-entrant (an
    inner generate() inside an outer one changes nothing: `record`, the model's, says so). Collective: call on
    every rank."""
    if record.generating:
        yield []
        return
    kept = groups_to_keep(model, budget)
    saved = [(g, _reshard_setting(g)) for g in kept]
    record.generating = True
    try:
        for group in kept:
            group.set_reshard_after_forward(False, recurse=False)
        if kept and len(kept) == len(_groups(model)):
            with _light_forward_hooks(model, kept):
                yield kept
        else:
            yield kept
    finally:
        record.generating = False
        for group, setting in saved:
            _restore_reshard_setting(group, setting)
        reshard(model)


@contextlib.contextmanager
def _light_forward_hooks(model: nn.Module, groups: list[nn.Module]) -> Iterator[None]:
    """Every group gathered up front (one all-gather each, in module order), then FSDP2's forward hooks
    replaced, in place, by hooks that only do their mixed-precision casts (FSDP2's own cast functions).

    With every parameter unsharded and no gradient, FSDP2's per-forward hooks have nothing to gather,
    free or register, yet cost ~170 us per group per token in Python here (and on a GPU, where decoding
    is launch-bound, as much). Replacing the hook at its key keeps every other hook's order; the
    originals go back on exit, before the groups are resharded."""
    model._get_fsdp_state()._lazy_init()  # the root's one-time setup, as its first forward would do
    for group in groups:
        group.unshard()
    swapped = []  # (hooks dict, key, FSDP2's hook)
    try:
        for group in groups:
            state = group._get_fsdp_state()
            pre_dicts = {id(m._forward_pre_hooks) for m in state._modules}
            for handle in _handles(state):
                hooks = handle.hooks_dict_ref()
                if hooks is None or handle.id not in hooks:
                    continue
                swapped.append((hooks, handle.id, hooks[handle.id]))
                upstream.set_item(hooks, handle.id, _cast_inputs(state) if id(hooks) in pre_dicts
                                  else _cast_output(state), _HOOK_HANDLE)
        yield
    finally:
        for hooks, key, original in swapped:
            upstream.set_item(hooks, key, original, _HOOK_HANDLE)


def _handles(state) -> list:
    """FSDP2's forward-hook handles of a group: one pre and one post handle, or a `_MultiHandle` of
    both per module for a group of several modules ([norm, lm_head])."""
    out = []
    for handle in {id(h): h for h in (state._pre_forward_hook_handle, state._post_forward_hook_handle)}.values():
        out.extend(getattr(handle, "handles", (handle,)))
    return out


def _cast_inputs(state):
    """FSDP2's input cast, skipped when nothing in the inputs has another floating dtype: a decoder layer's
    inputs are already in `param_dtype` at every token, and FSDP2's cast walks them all (with a profiler
    range) to find that out (~0.6 ms a token over 18 groups on the CPU check)."""
    policy = state._mp_policy
    dtype = policy.param_dtype if policy.cast_forward_inputs else None
    if dtype is None:
        return lambda module, args, kwargs: None

    def hook(module, args, kwargs):
        if inputs_need_cast(args, dtype) is False and inputs_need_cast(kwargs, dtype) is False:
            return None  # the inputs as they are: what FSDP2's cast would return
        return fsdp_state.cast_forward_inputs(state, args, kwargs)
    return hook


def inputs_need_cast(value, dtype: torch.dtype, depth: int = 0):
    """False when `value` holds no floating tensor of a dtype other than `dtype` where FSDP2's cast looks
    (torch.distributed.utils._apply_to_tensors: tensors, lists, tuples, dicts, dataclasses); True when it
    does; None when unsure (a dict below the top level, a dataclass, a deep nesting): let FSDP2 cast.
    Called per group per token: the common cases (None, a tensor, a tuple of tensors) are checked first."""
    if value is None or type(value) in _SCALARS:
        return False
    if isinstance(value, torch.Tensor):
        return value.dtype != dtype and value.is_floating_point()
    if isinstance(value, (tuple, list)) or (depth == 0 and isinstance(value, dict)):
        if depth > 2:
            return None
        unsure = False
        for item in (value.values() if isinstance(value, dict) else value):
            verdict = inputs_need_cast(item, dtype, depth + 1)
            if verdict:
                return True
            unsure = unsure or verdict is None
        return None if unsure else False
    if isinstance(value, dict) or dataclasses.is_dataclass(value) or (
            hasattr(value, "data") and hasattr(value, "batch_sizes")):  # dicts below the top, PackedSequence
        return None
    return False


_SCALARS = frozenset({int, float, bool, str})


def _cast_output(state):
    if state._mp_policy.output_dtype is None:  # FSDP2's post-forward cast would return the output as it is
        return lambda module, args, output: None

    def hook(module, args, output):
        return fsdp_state.cast_output(state, output)
    return hook


def _reshard_setting(group: nn.Module):
    # FSDP2 keeps the setting per parameter group (`post_forward_mesh_info`: None = keep unsharded, else
    # the mesh to reshard to) plus the root's automatic choice; set_reshard_after_forward overwrites both.
    state = group._get_fsdp_state()
    return state._auto_reshard_after_forward, [g.post_forward_mesh_info for g in fsdp_state.param_groups(state)]


def _restore_reshard_setting(group: nn.Module, setting) -> None:
    auto, infos = setting
    state = group._get_fsdp_state()
    upstream.set_state(state, "_auto_reshard_after_forward", auto, f"{_FSDP_STATE}._auto_reshard_after_forward")
    for param_group, info in zip(fsdp_state.param_groups(state), infos):
        upstream.set_state(param_group, "post_forward_mesh_info", info,
                           "torch.distributed.fsdp._fully_shard._fsdp_param_group.FSDPParamGroup.post_forward_mesh_info")
