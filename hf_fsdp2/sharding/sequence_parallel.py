"""Ulysses sequence parallelism (SP) composed with FSDP2: each rank of the mesh's "sp" dimension holds 1/sp of
every sequence; around the model's own attention an all-to-all turns sequence shards into head shards and back.

DeepSpeed's ALST (`UlyssesSPAttentionHF.register_with_transformers`, which Accelerate 1.15 calls for
`sp_backend: deepspeed`) is the model: the wrapper goes where transformers looks attention up, its
`AttentionInterface`, under a name of its own that the model's config points at (`set_attn_implementation`), the
model's own implementation (sdpa or eager) running inside on full sequences and 1/sp of the heads.
Nothing of transformers' is replaced:
- attention: q [b, H, s/sp, d] -> all-to-all -> [b, H/sp, s, d] (k, v likewise; key/value heads fewer than sp
  are repeated to sp first, as ALST does), the core implementation, and back to [b, s/sp, H, d];
- the mask: transformers skips mask creation for a name its `AttentionMaskInterface` does not know, so one is
  registered too; it gathers the 2-D padding mask over the sp ranks and builds the core's mask for the whole
  sequence (token order: sp rank 0's shard first);
- the loss: the model's own loss with the batch's `shift_labels` (labels shifted before the split, so a shard's
  last token keeps its target on the next rank) and `num_items_in_batch` (valid tokens of the whole sequences),
  so each rank's loss is its valid tokens' sum / the global count; their sum over the sp ranks (a differentiable
  all-reduce) is the loss. Its backward all-reduces too, giving each rank sp x its shard's gradient, which
  FSDP2's average over dp_shard x sp (runtime/distributed.data_parallel_mesh) turns into the one-process gradient.
  Per-token outputs a trainer computes its own loss from (TRL's fused LM head: log_probs, entropy, label_mask, of
  the shard's [rows, tokens]) are gathered along the sequence, differentiably: every rank's loss then covers the
  whole sequences and the gather's backward sums each token's gradient over the sp ranks, as the all-reduce does.
- `split_batch` cuts a batch along the sequence for a rank, position ids following their tokens. A plain loop calls
  it (hf_fsdp2.local_batch); under Accelerate (and so the Trainer) `split_in_forward` has the model's training
  forward call it on the whole sequences it is given (the data loader hands every rank of an sp group the same
  rows: integrations/accelerate.py), so the count of valid tokens a caller passes as `num_items_in_batch` is over
  whole sequences too.

Only in training mode (as ALST's `disable_in_eval`): evaluation and generation run whole sequences on each rank.

Around the sp groups, more ranks may hold other parts of the same sequences (`Outer`: the engine builds one for ring
attention over the "cp" ranks, sp within a machine, cp across): the batch is first laid out in the outer split's token
order and cut over all of them (outer rank-major, so an sp group holds one outer rank's part, its ranks that part's
pieces in order); after the all-to-all an sp group's ranks hold their part's tokens for 1/sp of the heads, and the
outer attention (torch's ring) runs causal attention over the outer ranks instead of the core; the loss is summed,
and per-token outputs and the positions of the packing check gathered, over all of them (back in sequence order).
"""

from __future__ import annotations

import inspect
import itertools
import sys
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
# transformers is imported where it is used: the planner imports this module (heads), and the command line's
# config checker must not import transformers (nor, through it, accelerate and torchao)
from torch import nn

from ..config import FSDP2Config
from .model_parts import ModelParts

IGNORE_INDEX = -100  # transformers' ForCausalLMLoss default
# The cores run (and tested) here. flash_attention_* read `position_ids` (packed sequences) that would need
# gathering first: not done. flex_attention: not done either. Its forward under Ulysses matched one process (tiny
# Llama, sp 2, training mode under no_grad, with and without left padding: rel 1e-7; `_mask` already builds its
# BlockMask for the whole sequence through transformers' flex_attention_mask), but torch 2.13's flex_attention
# refuses backward on CPU (torch/nn/attention/flex_attention.py, _validate_device), so its gradients were never
# compared, and its first compiled forwards took 25-45 s per process here, past the CI's budget.
_CORES = ("sdpa", "eager")
_PER_HEAD_ARGUMENTS = ("position_bias", "s_aux", "sinks")  # would need splitting by head too: not done
_SPLIT_KEYS = ("input_ids", "labels", "shift_labels", "position_ids", "attention_mask", "inputs_embeds",
               "token_type_ids")
_names = itertools.count()


@dataclass(frozen=True)
class Outer:
    """Ranks beyond the sp group holding other parts of the same sequences. `group` spans them and the sp ranks,
    outer rank-major (rank = outer rank x sp + sp rank: the engine flattens the mesh's outer and "sp" dimensions);
    `order(length, device)`: the sequence's token indices in the order the group's ranks hold them, rank after rank;
    `attention(query, key, value, scale)`: causal attention of an sp group's part ([b, heads, part, d], laid out in
    `order`) over the outer ranks, no mask; `check(attention_mask)`: refuses by name what that attention would not
    honour in a training forward's batch (collective); `setting`: how messages name the outer split."""
    group: dist.ProcessGroup
    rank: int
    size: int
    order: Callable[..., torch.Tensor]
    attention: Callable[..., torch.Tensor]
    check: Callable[[Any], None]
    setting: str


@dataclass
class _Ulysses:
    """One model's SP: its group, this rank's place in it, the core implementation, whether this forward's inputs
    are shards, and whether the training forward is given whole sequences and keeps this rank's shard itself."""
    group: dist.ProcessGroup
    size: int
    rank: int
    core: str
    active: bool = False
    splits_inputs: bool = False
    tokens: tuple[int, int] | None = None  # this training forward's (rows, tokens per row) on this rank
    outer: Outer | None = None

    @property
    def whole(self) -> tuple[dist.ProcessGroup, int, int]:
        """(group, rank, size) of all the ranks holding parts of the same sequences: the sp group, or the outer's."""
        return (self.group, self.rank, self.size) if self.outer is None else (
            self.outer.group, self.outer.rank, self.outer.size)


_STATES: "weakref.WeakKeyDictionary[nn.Module, _Ulysses]" = weakref.WeakKeyDictionary()  # ModelParts.model -> its SP


# ---------------------------------------------------------------------------------------------
# Refusals and application


def heads(config) -> tuple[int, int]:
    """(attention heads, key/value heads) of a transformers config (its text config for multimodal models)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    h = getattr(text, "num_attention_heads", None)
    if not isinstance(h, int):
        raise ValueError(f"`sp_size`: {type(text).__name__} names no `num_attention_heads`; Ulysses splits the "
                         "attention heads over the sp ranks and needs their number.")
    kv = getattr(text, "num_key_value_heads", None) or h
    return h, kv


def refuse_unsupported(parts: ModelParts, sp: int) -> None:
    """What Ulysses cannot split, by name, before anything changes."""
    config = getattr(parts.base, "config", None)
    if config is None or not hasattr(parts.base, "set_attn_implementation"):
        raise ValueError(f"`sp_size`={sp}: {type(parts.base).__name__} is not a transformers model; Ulysses goes "
                         "through transformers' attention interface.")
    h, kv = heads(config)
    if h % sp:
        raise ValueError(f"`sp_size`={sp} must divide the model's {h} attention heads (num_attention_heads): "
                         "Ulysses gives each sp rank 1/sp_size of the heads.")
    if kv % sp and sp % kv:
        raise ValueError(f"`sp_size`={sp} and the model's {kv} key/value heads (num_key_value_heads): one must divide "
                         "the other (fewer key/value heads than sp ranks are repeated to sp).")
    core = config._attn_implementation
    if core not in _CORES:
        raise ValueError(f"`sp_size`={sp} with attn_implementation={core!r}: Ulysses wraps one of {list(_CORES)}.")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    others = sorted({t for t in (getattr(text, "layer_types", None) or ()) if "attention" not in str(t)})
    if others:  # recurrent state across the sequence (Accelerate refuses them under ALST too)
        raise ValueError(f"`sp_size`={sp}: the model has {others} layers, which carry state along the sequence "
                         "outside the attention Ulysses splits; not done.")


def apply_sequence_parallel(parts: ModelParts, config: FSDP2Config, sp_mesh, outer: Outer | None = None) -> None:
    """Point the model's attention at the Ulysses wrapper of its own implementation and hook its forward (the
    checks at a training forward, the loss summed over the sp ranks, and the `outer` ranks). Before `fully_shard`."""
    sp = sp_mesh.size()
    refuse_unsupported(parts, sp)
    base = parts.base
    if outer is not None and base.config._attn_implementation != "sdpa":
        raise ValueError(f"`sp_size`={sp} with {outer.setting} and attn_implementation="
                         f"{base.config._attn_implementation!r}: the ring attention runs SDPA's kernels; load the "
                         "model with attn_implementation='sdpa'.")
    state = _Ulysses(sp_mesh.get_group(), sp, sp_mesh.get_local_rank(), base.config._attn_implementation,
                     outer=outer)
    _STATES[parts.model] = state
    name = f"hf_fsdp2_ulysses_{next(_names)}"
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, lambda *args, **kwargs: _attention(state, *args, **kwargs))
    AttentionMaskInterface.register(name, lambda **kwargs: _mask(state, **kwargs))
    base.set_attn_implementation(name)
    parts.model.register_forward_pre_hook(lambda module, args, kwargs: _before_forward(state, module, args, kwargs),
                                          with_kwargs=True)
    parts.model.register_forward_hook(lambda module, args, output: _after_forward(state, output))


def split_in_forward(parts: ModelParts) -> None:
    """From now on the model's training forwards take whole sequences (every rank of an sp group the same rows) and
    keep this rank's 1/sp of them (`split_batch`), so the loop does not: what Accelerate's prepare (and so the
    Trainer) asks for. Evaluation forwards run whole sequences as before. Nothing for a model without Ulysses."""
    state = _STATES.get(parts.model)
    if state is not None:
        state.splits_inputs = True


def refuse_accelerate_sp_size(parallelism_config) -> None:
    """Accelerate's own sequence-parallel size above 1 (DeepSpeed's Ulysses) would otherwise become a silent
    data-parallel run over those ranks: refused where the model is prepared, naming hf_fsdp2's own setting."""
    pc = parallelism_config
    if (getattr(pc, "sp_size", 1) or 1) > 1:
        # Accelerate 1.15's ParallelismConfig accepts sp_backend "deepspeed" only (its __post_init__) and builds no
        # mesh for it; the Trainer, seeing sp_size, multiplies its dataloader length by it (DeepSpeed's adapter runs
        # each loaded batch as sp shards) and divides its token count by it. Naming hf_fsdp2 there would tell them
        # something else than what runs: hf_fsdp2's Ulysses is its own setting, which they do not see.
        raise ValueError(f"parallelism_config sp_size={pc.sp_size}: sequence parallelism through Accelerate is "
                         "DeepSpeed's (sp_backend: deepspeed only), which hf_fsdp2 does not run. For hf_fsdp2's "
                         "Ulysses x FSDP2 leave parallelism_config_sp_size at 1 and set HF_FSDP2_SP_SIZE (or "
                         "hf_fsdp2.register(sp_size=...)): the prepared data loader gives the ranks of an sp group "
                         "the same rows and the prepared model's training forward keeps each rank's slice of every "
                         "sequence (docs/parallelism.md).")


def refuse_without_fsdp2(sp_size: int, is_fsdp2: bool) -> None:
    """hf_fsdp2's sp_size where Accelerate does not hand the model to hf_fsdp2: its training forward would not split
    the rows the ranks share."""
    if sp_size > 1 and not is_fsdp2:
        raise ValueError(f"sp_size={sp_size} (hf_fsdp2.register() / HF_FSDP2_SP_SIZE) needs FSDP2 (an FSDP config "
                         "with fsdp_version: 2): hf_fsdp2's Ulysses runs in the models it shards.")


def refuse_dispatched_loader(sp_size: int) -> None:
    """Accelerate's batch dispatcher slices rank 0's batches by the state's rank, not by the sp group."""
    raise ValueError(f"sp_size={sp_size} with Accelerate's batch dispatching (an IterableDataset, or "
                     "dispatch_batches=True) is not done in hf_fsdp2: the dispatcher gives every rank rows of its "
                     "own. Use a map-style dataset, or DataLoaderConfiguration(dispatch_batches=False).")


def splits_in_forward(parts: ModelParts) -> bool:
    """Whether `split_in_forward` was asked for this model (its batches must not be split before the forward)."""
    state = _STATES.get(parts.model)
    return state is not None and state.splits_inputs


# ---------------------------------------------------------------------------------------------
# The forward


def _argument(module: nn.Module, name: str, args: tuple, kwargs: dict) -> Any:
    if name in kwargs:
        return kwargs[name]
    try:
        return inspect.signature(module.forward).bind_partial(*args).arguments.get(name)
    except TypeError:
        return None


def _before_forward(state: _Ulysses, module: nn.Module, args: tuple, kwargs: dict):
    """A training forward takes sequence shards (`split_batch`'s; under `split_in_forward` it cuts them here from
    the whole sequences it is given); what would silently train wrong is refused."""
    state.active = module.training
    if not state.active:
        return None
    if state.splits_inputs:
        names = list(inspect.signature(module.forward).parameters)
        whole = {**dict(zip(names, args)), **kwargs}
        group_rank, group_size = state.whole[1:]
        args, kwargs = (), split_batch(whole, group_rank, group_size, state.outer and state.outer.order)
    get = lambda name: _argument(module, name, args, kwargs)  # noqa: E731
    reference = get("input_ids") if get("input_ids") is not None else get("inputs_embeds")
    state.tokens = tuple(reference.shape[:2]) if reference is not None else None
    if get("position_ids") is None:
        raise ValueError(f"sp_size={state.size}: this training forward has no `position_ids`, so each rank would "
                         "number its sequence shard from 0. Split the batch with hf_fsdp2.local_batch (it "
                         "adds them).")
    if get("labels") is not None and (get("shift_labels") is None or get("num_items_in_batch") is None):
        raise ValueError(f"sp_size={state.size}: labels without `shift_labels` and `num_items_in_batch`: a shard's "
                         "last token would lose its target (on the next rank) and the loss would be a mean of "
                         "per-rank means. Split the batch with hf_fsdp2.local_batch (it adds both).")
    if state.outer is not None:
        state.outer.check(get("attention_mask"))
    if get("attention_mask") is None:
        positions = _gather_sequence(get("position_ids").expand(_batch_size(module, args, kwargs), -1), state,
                                     whole=True)
        from transformers.masking_utils import find_packed_sequence_indices

        if find_packed_sequence_indices(positions) is not None:
            raise ValueError(f"sp_size={state.size}: the batch packs several sequences per row (position_ids restart) "
                             "without an attention_mask (e.g. TRL's padding_free or packing); packed sequences under "
                             "Ulysses are not done in hf_fsdp2.")
    return (args, kwargs) if state.splits_inputs else None


def _batch_size(module: nn.Module, args: tuple, kwargs: dict) -> int:
    for name in ("input_ids", "inputs_embeds"):
        value = _argument(module, name, args, kwargs)
        if value is not None:
            return value.shape[0]
    return 1


def _after_forward(state: _Ulysses, output: Any) -> Any:
    loss = getattr(output, "loss", None)
    if state.active and loss is not None and getattr(output, "aux_loss", None) is not None:
        # A mixture-of-experts model's router loss (output_router_logits) is a mean over the tokens it routed: on a
        # shard it is that shard's, and summing the sp ranks' losses would count it sp times.
        raise ValueError(f"sp_size={state.size}: the model adds a router auxiliary loss (output_router_logits) to its "
                         "loss, computed over this rank's sequence shard only; under Ulysses that is not done. Set "
                         "output_router_logits=False or train without sp_size.")
    if state.active and loss is not None:
        # Each rank's loss is its shard's sum / the global count: their sum is the loss; the backward all-reduce
        # gives each rank sp x its shard's gradient, FSDP2's average over the sp ranks their sum.
        # With an outer split, over all the ranks holding parts of the sequences: FSDP2 averages over them too.
        output["loss"] = funcol.all_reduce(loss, "sum", state.whole[0])  # torch registers its backward: all_reduce
    if state.active and isinstance(output, Mapping):
        # Per-token outputs ([rows, tokens], e.g. TRL's fused LM head: log_probs, entropy, label_mask), from which a
        # trainer computes its own loss, cover the whole sequences: gathered along them, the log-probabilities
        # differentiably (the backward sums each token's gradient from every rank, as the loss's all-reduce does).
        for key, value in list(output.items()):
            if isinstance(value, torch.Tensor) and tuple(value.shape) == state.tokens:
                output[key] = _gather_per_token(value, state)
    state.active = False
    return output


def _gather_per_token(local: torch.Tensor, state: _Ulysses) -> torch.Tensor:
    if not local.is_floating_point():
        return _gather_sequence(local, state, whole=True)
    gathered = funcol.all_gather_tensor_autograd(local.contiguous(), 1, state.whole[0])  # backward: reduce-scatter
    return _in_sequence_order(gathered, state)


def _in_sequence_order(gathered: torch.Tensor, state: _Ulysses) -> torch.Tensor:
    """[b, s, ...] gathered over the outer split's ranks (its token order) put back in sequence order."""
    if state.outer is None:
        return gathered
    order = state.outer.order(gathered.shape[1], gathered.device)
    return gathered.index_select(1, torch.argsort(order))


def _gather_sequence(local: torch.Tensor, state: _Ulysses, whole: bool = False) -> torch.Tensor:
    """[b, s/sp] integer or boolean tensors of the sp ranks, concatenated along the sequence (not differentiable);
    `whole`: of all the ranks holding parts of the sequences (the outer's too), in sequence order."""
    group, _, size = state.whole if whole else (state.group, state.rank, state.size)
    source = local.to(torch.int64).contiguous()
    parts = [torch.empty_like(source) for _ in range(size)]
    dist.all_gather(parts, source, group=group)
    gathered = torch.cat(parts, dim=1)
    return (_in_sequence_order(gathered, state) if whole else gathered).to(local.dtype)


def _all_to_all(x: torch.Tensor, state: _Ulysses, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split `x` into sp chunks along `scatter_dim`, send chunk j to sp rank j, concatenate what arrives along
    `gather_dim` in rank order (differentiable: its backward is the reverse all-to-all)."""
    sp = state.size
    shape = list(x.shape)
    chunks = x.reshape(*shape[:scatter_dim], sp, shape[scatter_dim] // sp, *shape[scatter_dim + 1:])
    chunks = chunks.movedim(scatter_dim, 0).contiguous()
    received = funcol.all_to_all_single_autograd(chunks, None, None, state.group)
    # [sp (source rank), ...the chunk's dims...]: the source rank's index goes just before gather_dim
    received = received.movedim(0, gather_dim)
    out = list(chunks.shape[1:])
    out[gather_dim] *= sp
    return received.reshape(out)


class _Heads:
    """The attention module as the core implementation sees it, with its key/value groups as they are on this rank
    (query heads / key-value heads after the all-to-all differ from the module's when key/value heads were
    repeated); everything else is the module's."""

    def __init__(self, module: nn.Module, groups: int):
        self._module, self.num_key_value_groups = module, groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _core(state: _Ulysses, module: nn.Module) -> Callable:
    if state.core == "eager":  # the model's own eager function, from its modeling module (as its forward finds it)
        return sys.modules[type(module).__module__].eager_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[state.core]


def _attention(state: _Ulysses, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask, **kwargs):
    core = _core(state, module)
    if not module.training:  # the module's mode, not the forward's flag: a checkpointed layer recomputes in backward
        return core(module, query, key, value, attention_mask, **kwargs)
    named = [name for name in _PER_HEAD_ARGUMENTS if kwargs.get(name) is not None or hasattr(module, name)]
    if named:
        raise ValueError(f"sp_size={state.size}: the attention takes per-head `{named[0]}`, which Ulysses would have "
                         "to split by head; not done.")
    sp = state.size
    if key.shape[1] < sp:  # fewer key/value heads than ranks: each repeated so every rank gets the one it needs
        repeat = sp // key.shape[1]
        key, value = (t.repeat_interleave(repeat, dim=1) for t in (key, value))
    # [b, heads, s/sp, d] -> [b, heads/sp, s, d]
    query, key, value = (_all_to_all(t, state, scatter_dim=1, gather_dim=2) for t in (query, key, value))
    groups = query.shape[1] // key.shape[1]
    if state.outer is not None:
        return _outer_attention(state, module, query, key, value, attention_mask, kwargs), None
    target = module if groups == getattr(module, "num_key_value_groups", 1) else _Heads(module, groups)
    out, _ = core(target, query, key, value, attention_mask, **kwargs)
    # [b, s, heads/sp, d] -> [b, s/sp, heads, d], as the core returns it without SP
    return _all_to_all(out, state, scatter_dim=1, gather_dim=2), None


def _outer_attention(state: _Ulysses, module: nn.Module, query, key, value, attention_mask,
                     kwargs: dict) -> torch.Tensor:
    """The outer split's causal attention of this sp group's part (all its tokens, 1/sp of the heads) instead of the
    core; what it would not honour refused by name. Returns [b, s/sp, heads, d] as the core's output comes back."""
    ignored = [name for name in ("softcap", "sliding_window", "position_bias") if kwargs.get(name) is not None]
    ignored += ["attention_mask"] if attention_mask is not None else []
    ignored += ["dropout"] if kwargs.get("dropout") else []
    ignored += ["is_causal=False"] if False in (kwargs.get("is_causal"), getattr(module, "is_causal", True)) else []
    if ignored:
        raise ValueError(f"sp_size={state.size} with {state.outer.setting}: the attention is given `{ignored[0]}`, "
                         "which the ring attention (causal, no mask, no dropout) does not take; not done.")
    # grouped key/value heads go around the ring as they are (the outer attention repeats them for its kernel)
    out = state.outer.attention(query, key, value, kwargs.get("scaling"))  # [b, heads/sp, s_part, d]
    return _all_to_all(out.transpose(1, 2), state, scatter_dim=1, gather_dim=2)


def _mask(state: _Ulysses, *, batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0,
          attention_mask=None, **kwargs):
    """The core implementation's mask for the whole sequence: the padding mask gathered over the sp ranks."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    core = ALL_MASK_ATTENTION_FUNCTIONS[state.core]
    if state.active:
        if q_offset or kv_offset or kv_length != q_length:
            raise ValueError(f"sp_size={state.size}: a training forward with a cache (past key values) is not done.")
        if state.outer is not None:  # causal over the whole sequence, the outer attention's (padding refused)
            if kwargs.get("local_size") is not None:
                raise ValueError(f"sp_size={state.size} with {state.outer.setting}: the model's attention is local "
                                 "(sliding window or chunked), which the ring attention (causal over the whole "
                                 "sequence) does not do; not done.")
            return None
        if attention_mask is not None:
            attention_mask = _gather_sequence(attention_mask, state)
        q_length = kv_length = q_length * state.size
    return core(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset, kv_offset=kv_offset,
                attention_mask=attention_mask, **kwargs)


# ---------------------------------------------------------------------------------------------
# The batch


def rank_batch(parts: ModelParts, batch: Mapping[str, Any]) -> dict[str, Any]:
    """This rank's part of a batch of whole sequences under the model's Ulysses (and its outer split, if any)."""
    state = _STATES[parts.model]
    _, rank, size = state.whole
    return split_batch(batch, rank, size, state.outer and state.outer.order)


def split_batch(batch: Mapping[str, Any], rank: int, size: int,
                order: Callable[..., torch.Tensor] | None = None) -> dict[str, Any]:
    """This sp rank's part of a batch of whole sequences: input_ids, labels, attention_mask, position_ids, ...
    cut along the sequence (dim 1) into `size` equal shards, shard `rank` kept. Added first, for the whole
    sequence: `position_ids` (0..s-1 when absent), `shift_labels` (labels shifted left by one, -100 last) and
    `num_items_in_batch` (their valid tokens: the loss's divisor). Other entries pass unchanged. With an outer
    split (`Outer.order`; `rank` and `size` then its group's) the tokens are laid out in its order first."""
    batch = dict(batch)
    reference = batch.get("input_ids", batch.get("inputs_embeds"))
    if reference is None:
        raise ValueError("local_batch: the batch has neither `input_ids` nor `inputs_embeds`.")
    rows, length = reference.shape[:2]
    if length % size:
        raise ValueError(f"{'sp_size' if order is None else 'sp_size x cp_size'}={size} must divide the batch's "
                         f"sequence length {length}: pad the batch to a multiple of {size} (e.g. "
                         f"DataCollatorWithPadding(pad_to_multiple_of={size})).")
    if batch.get("position_ids") is None:
        batch["position_ids"] = torch.arange(length, device=reference.device).expand(rows, -1)
    if batch.get("labels") is not None:
        labels = batch["labels"]
        if batch.get("shift_labels") is None:
            batch["shift_labels"] = nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]
        if batch.get("num_items_in_batch") is None:
            batch["num_items_in_batch"] = (batch["shift_labels"] != IGNORE_INDEX).sum()
    shard = length // size
    if batch["position_ids"].dim() < 2 or batch["position_ids"].shape[0] != rows:  # a [1, s] or [s] position_ids
        batch["position_ids"] = batch["position_ids"].reshape(-1, length).expand(rows, -1)
    if order is not None:
        tokens = order(length, reference.device)
        for key in _SPLIT_KEYS:
            value = batch.get(key)
            if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == length:
                batch[key] = value.index_select(1, tokens)
    for key in _SPLIT_KEYS:
        value = batch.get(key)
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == length:
            batch[key] = value[:, rank * shard:(rank + 1) * shard].contiguous()
        elif isinstance(value, torch.Tensor):
            raise ValueError(f"local_batch: `{key}` of shape {tuple(value.shape)} is not [batch, "
                             f"{length}, ...]; it cannot be cut along the sequence.")
    return batch


__all__ = ["Outer", "apply_sequence_parallel", "heads", "rank_batch", "refuse_unsupported", "split_batch",
           "split_in_forward", "splits_in_forward", "refuse_accelerate_sp_size", "refuse_without_fsdp2",
           "refuse_dispatched_loader"]
