"""Sequence tiling: the loss and the decoder MLPs computed a tile of tokens at a time, so activation memory stops
growing with the vocabulary and the intermediate size (DeepSpeed ALST's TiledFusedLogitsLoss and TiledMLP are the
model). With or without sequence parallelism; only in training forwards (evaluation keeps whole logits).

- Loss (`loss_tile_size`): a training forward with labels hands them to the tiled loss instead of the model (a
  pre-hook on the model takes them out of its arguments); the lm_head's input is kept and the lm_head itself runs on
  the last position only (the forward's `logits`); the lm_head + cross-entropy then run tile by tile on the kept
  hidden states, each tile's gradients (hidden states, weight, bias) computed as it goes (fused, as Liger's
  linear cross-entropy), so one tile's logits live at a time and backward needs no recomputation, nor the
  weight gathered again. Inside the lm_head's call (its forward hook, before FSDP2's), so the weight is the
  gathered one; its gradient reaches the parameter as a Linear's does and FSDP2 reduce-scatters it. The value is
  transformers' ForCausalLMLoss: the valid tokens' sum over `num_items_in_batch` when given, else their mean.
- MLP (`mlp_tile_size`): each decoder layer's `mlp` wrapped (torch's ActivationWrapper: parameter and state-dict
  names unchanged) so it runs per tile of tokens under a non-reentrant checkpoint: a tile's intermediate
  activations are recomputed in backward, one tile at a time.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper
from torch.utils.checkpoint import checkpoint

from ..config import FSDP2Config
from .model_parts import ModelParts

IGNORE_INDEX = -100
_LOSS_KEYS = ("labels", "shift_labels", "num_items_in_batch")
_LOGIT_CHANGES = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


# ---------------------------------------------------------------------------------------------
# The loss


class _LinearCrossEntropy(torch.autograd.Function):
    """sum over valid tokens of cross_entropy(hidden @ weight.T + bias, targets) / divisor, a tile of tokens at a
    time; the gradients are computed in forward, tile by tile, and only scaled in backward. A weight (and bias) split
    along the vocabulary over a mesh dimension (`_vocabulary_split`: a column-wise parallel head) is computed on each
    rank's rows, the softmax's max, sum and target logit all-reduced over that dimension's group per tile (the
    vocabulary-parallel cross-entropy of Megatron-LM and torch's `loss_parallel`), so no rank holds the whole head."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, divisor, tile):  # noqa: D102
        flat, labels = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
        weight_rows, first, group = _vocabulary_split(weight)
        bias_rows = bias.to_local() if group is not None and bias is not None else bias
        wants = ctx.needs_input_grad
        grad_hidden = torch.zeros_like(flat) if wants[0] else None
        # Summed over the tiles in the weight's dtype, as autograd sums a gradient; kept from here to backward
        # (the price of no recomputation: the planner counts it, it is a saved tensor)
        grad_weight = torch.zeros_like(weight_rows) if wants[1] else None
        grad_bias = torch.zeros_like(bias_rows) if wants[2] else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, flat.shape[0], tile):
            h, t = flat[start:start + tile], labels[start:start + tile]
            logits = F.linear(h, weight_rows, bias_rows).float()  # the model's dtype, upcast as ForCausalLMLoss does
            valid = (t != IGNORE_INDEX).unsqueeze(1)
            if group is None:
                total += F.cross_entropy(logits, t, ignore_index=IGNORE_INDEX, reduction="sum")
                if not any(wants[:3]):
                    del logits
                    continue
                # At most two [tile, vocab] fp32 buffers live at once, as the planner counts (_loss_backward_bytes):
                # the logits go once their softmax exists, the gradient is made in place, and both names are dropped
                # before the next tile's logits (a rebinding would hold the old ones while the new are made: 3,
                # measured 1.12x).
                grad = torch.softmax(logits, dim=-1)  # d sum / d logits = softmax - one hot, 0 on ignored tokens
                del logits
                index, hit = t.clamp(min=0).unsqueeze(1), valid
            else:
                total += _split_vocabulary_loss_(logits, t, valid, first, group)  # logits -> their softmax, in place
                grad = logits
                del logits
                index = (t - first).clamp(0, grad.shape[1] - 1).unsqueeze(1)
                hit = valid & ((t >= first) & (t < first + grad.shape[1])).unsqueeze(1)  # the target is in our rows
            grad.scatter_add_(1, index, -hit.to(grad.dtype))  # no data-dependent shape:
            grad = grad.mul_(valid).to(h.dtype)  # the planner traces it on the meta device
            if grad_hidden is not None:
                grad_hidden[start:start + tile] = grad @ weight_rows
            if grad_weight is not None:
                grad_weight += grad.t() @ h
            if grad_bias is not None:
                grad_bias += grad.sum(0)
            del grad
        if grad_hidden is not None and group is not None:  # each rank's rows gave part of every token's gradient
            dist.all_reduce(grad_hidden, group=group)
        ctx.divisor = divisor
        ctx.shape = hidden.shape
        ctx.weights = tuple((p.device_mesh, p.placements, p.shape, p.stride()) if isinstance(p, DTensor) else None
                            for p in (weight, bias))
        ctx.save_for_backward(*(g if g is not None else torch.empty(0) for g in (grad_hidden, grad_weight, grad_bias)))
        return total / divisor

    @staticmethod
    def backward(ctx, grad_out):  # noqa: D102
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        scale = grad_out / ctx.divisor
        wants = ctx.needs_input_grad

        def like_parameter(grad, spec):  # a split weight's gradient: its rows, as the same DTensor layout
            return grad if spec is None else DTensor.from_local(grad, spec[0], spec[1], shape=spec[2], stride=spec[3])

        return (
            (grad_hidden * scale.to(grad_hidden.dtype)).reshape(ctx.shape) if wants[0] else None,
            like_parameter(grad_weight * scale.to(grad_weight.dtype), ctx.weights[0]) if wants[1] else None,
            like_parameter(grad_bias * scale.to(grad_bias.dtype), ctx.weights[1]) if wants[2] else None,
            None, None, None,
        )


def _vocabulary_split(weight: torch.Tensor):
    """(this rank's rows, the first row's index in the vocabulary, the group of ranks holding the others) of an
    output layer's weight: a DTensor sharded along dim 0 over one mesh dimension (a column-wise parallel head,
    after FSDP2 gathered its other dimension) is split, (weight, 0, None) is whole. Rows as torch.chunk gives them
    (DTensor's Shard: ceil(vocab / n) a rank, the last ones fewer)."""
    if not isinstance(weight, DTensor):
        return weight, 0, None
    split = [dim for dim, placement in enumerate(weight.placements) if placement.is_shard(0)]
    rest = [placement for dim, placement in enumerate(weight.placements) if dim not in split]
    if len(split) != 1 or not all(placement.is_replicate() for placement in rest):
        raise ValueError(f"`loss_tile_size`: the output layer's weight is laid out as {weight.placements} on its "
                         "mesh; the tiled loss computes a whole head, or one split along the vocabulary over one mesh "
                         "dimension (a column-wise parallel lm_head), not this one.")
    mesh, dim = weight.device_mesh, split[0]
    rows = -(-weight.shape[0] // mesh.size(dim))
    return weight.to_local(), mesh.get_local_rank(dim) * rows, mesh.get_group(dim)


def _split_vocabulary_loss_(logits: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor, first: int,
                            group) -> torch.Tensor:
    """The cross-entropy summed over the valid tokens of a tile whose logits are this rank's vocabulary rows
    [first, first + n): max, sum of exponentials and the target's logit all-reduced over `group` (two all-reduces a
    tile: the max, then both sums in one). `logits` becomes their softmax (this rank's columns of it), in place: one
    [tile, n] buffer."""
    mine = valid.squeeze(1) & (targets >= first) & (targets < first + logits.shape[1])
    target = logits.gather(1, (targets - first).clamp(0, logits.shape[1] - 1).unsqueeze(1)).squeeze(1) * mine
    top = logits.amax(dim=1)
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    logits.sub_(top.unsqueeze(1)).exp_()
    sums = torch.stack((logits.sum(dim=1), target))
    dist.all_reduce(sums, group=group)
    total, target = sums
    logits.div_(total.unsqueeze(1))
    return ((top + total.log() - target) * valid.squeeze(1)).sum()


def tiled_causal_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         labels: torch.Tensor | None, tile: int, *, shift_labels: torch.Tensor | None = None,
                         num_items_in_batch=None) -> torch.Tensor:
    """transformers' ForCausalLMLoss of `hidden @ weight.T + bias`, without the whole logits."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    shift_labels = shift_labels.to(hidden.device)
    divisor = num_items_in_batch if num_items_in_batch is not None else (shift_labels != IGNORE_INDEX).sum()
    if isinstance(divisor, torch.Tensor):
        divisor = divisor.to(hidden.device)
    return _LinearCrossEntropy.apply(hidden, weight, bias, shift_labels, divisor, tile)


@dataclass
class _Pending:
    """One training forward's labels, from the model's pre-hook to the lm_head's hooks, and the loss back."""
    tile: int
    labels: dict | None = None
    hidden: torch.Tensor | None = None
    loss: torch.Tensor | None = None


def _as_keywords(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A forward's positional arguments after the first moved to keywords, so labels passed by position are seen."""
    if len(args) <= 1:
        return args, kwargs
    params = [p for p in inspect.signature(module.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(params) < len(args):
        return args, kwargs
    return args[:1], {**{p.name: a for p, a in zip(params[1:], args[1:])}, **kwargs}


def refuse_loss_tiling(parts: ModelParts) -> nn.Module:
    """The lm_head the tiled loss computes, or a refusal by name of what it would compute differently."""
    base = parts.base
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if type(head) is not nn.Linear:
        raise ValueError(f"`loss_tile_size`: {type(base).__name__}'s output layer is "
                         f"{type(head).__name__ if head is not None else 'missing'}, not a plain nn.Linear (an adapter "
                         "or quantized head); the tiled loss computes a linear head only.")
    text = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    changed = [name for name in _LOGIT_CHANGES if getattr(text, name, None) not in (None, 1, 1.0)]
    if changed:
        raise ValueError(f"`loss_tile_size`: {type(base).__name__} transforms its logits (`{changed[0]}`), which the "
                         "tiled loss does not; not done.")
    from transformers.loss.loss_utils import ForCausalLMLoss  # here: the planner imports this module

    if getattr(base, "loss_function", None) is not ForCausalLMLoss:
        raise ValueError(f"`loss_tile_size`: {type(base).__name__}'s loss is not transformers' ForCausalLMLoss; the "
                         "tiled loss computes that one only.")
    return head


def _tile_loss(parts: ModelParts, tile: int) -> None:
    head = refuse_loss_tiling(parts)
    state = _Pending(tile)

    def before_model(module, args, kwargs):
        state.labels, state.hidden, state.loss = None, None, None
        args, kwargs = _as_keywords(module, args, kwargs)
        if not (module.training and torch.is_grad_enabled()) or kwargs.get("labels") is None:
            return args, kwargs
        state.labels = {key: kwargs.pop(key) for key in _LOSS_KEYS if key in kwargs}
        return args, kwargs

    def before_head(module, args):
        if state.labels is None:
            return None
        state.hidden = args[0]
        return (args[0][:, -1:],)  # the forward's logits: the last position only

    def after_head(module, args, output):
        if state.labels is not None and state.hidden is not None:
            labels = state.labels
            state.loss = tiled_causal_lm_loss(state.hidden, module.weight, module.bias, labels.get("labels"),
                                              state.tile,
                                              shift_labels=labels.get("shift_labels"),
                                              num_items_in_batch=labels.get("num_items_in_batch"))
            _gather_for_backward(module, state.hidden)
            state.hidden = None
        return output

    def after_model(module, args, output):
        if state.labels is not None:
            if state.loss is None:
                raise RuntimeError("`loss_tile_size`: the forward never ran its lm_head, so no loss was computed.")
            output["loss"] = state.loss + _router_aux_loss(parts, output, state.loss)
        state.labels, state.hidden, state.loss = None, None, None
        return output

    parts.model.register_forward_pre_hook(before_model, with_kwargs=True)
    parts.model.register_forward_hook(after_model, prepend=True)  # before other techniques' hooks read the loss
    head.register_forward_pre_hook(before_head)
    head.register_forward_hook(after_head)


def _gather_for_backward(head: nn.Module, hidden: torch.Tensor) -> None:
    """FSDP2 gathers a group again for backward from a hook on the group's forward output (for a group of several
    modules, the last one's: the lm_head's logits; torch's FSDPState._register_pre_backward_hook). The tiled loss's
    gradient bypasses those logits and reaches the head's input directly, so where the head's group is resharded
    after forward (the tied [embedding, norm, lm_head] group is) that hook never fired, and the final norm's backward
    read its freed weight: a segfault at Llama-3.2-1B's tied shape. Gathered here when the gradient reaches the head's
    input, with FSDP2's public `unshard` (a no-op for a group still gathered); the root's post-backward callback
    reshards it and reduce-scatters its gradients as after any backward."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(head, FSDPModule) and hidden.requires_grad:
        hidden.register_hook(lambda grad: head.unshard())  # returns None: the gradient passes unchanged


def _router_aux_loss(parts: ModelParts, output, loss: torch.Tensor) -> torch.Tensor | float:
    """What a mixture-of-experts model adds to its loss when it has labels (`output_router_logits`: Mixtral's,
    Qwen3-MoE's `loss += self.router_aux_loss_coef * aux_loss`): the labels went to the tiled loss, so the model
    computed `aux_loss` but added it to nothing. Added here as the model would; a model returning one without that
    coefficient is refused by name rather than trained without its router loss."""
    aux = output.get("aux_loss") if hasattr(output, "get") else None
    if aux is None:
        return 0.0
    coef = getattr(parts.base, "router_aux_loss_coef", None)
    if coef is None:
        raise ValueError(f"`loss_tile_size`: {type(parts.base).__name__} returns a router `aux_loss` but has no "
                         "`router_aux_loss_coef`, so how it joins the loss is unknown; not done.")
    return coef * aux.to(loss.device)


# ---------------------------------------------------------------------------------------------
# The MLP


class TiledMLP(ActivationWrapper):
    """A decoder layer's MLP run `tile` tokens at a time, each tile under a non-reentrant checkpoint."""

    def __init__(self, mlp: nn.Module, tile: int):
        super().__init__(mlp)
        self.tile = tile

    def forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        mlp = self._checkpoint_wrapped_module
        if not (self.training and torch.is_grad_enabled()) or hidden.dim() < 3 or hidden.shape[1] <= self.tile:
            return mlp(hidden, *args, **kwargs)
        outs = [checkpoint(mlp, part, *args, use_reentrant=False, **kwargs) for part in hidden.split(self.tile, dim=1)]
        return torch.cat(outs, dim=1)


def _tile_mlps(layers: list[nn.Module], tile: int) -> None:
    for layer in layers:
        mlp = getattr(layer, "mlp", None)
        if not isinstance(mlp, nn.Module) or hasattr(mlp, "experts"):
            raise ValueError(f"`mlp_tile_size`: the decoder layer {type(layer).__name__} has "
                             f"{'a mixture-of-experts block' if mlp is not None else 'no `mlp`'}; tiling a dense "
                             "`mlp` per token tile is what is done.")
        if not isinstance(mlp, TiledMLP):
            layer.register_module("mlp", TiledMLP(mlp, tile))


def apply_sequence_tiling(parts: ModelParts, layers: list[nn.Module], config: FSDP2Config) -> None:
    """The tiled loss on the model and its lm_head, the tiled MLP in each decoder layer. Before `fully_shard`
    (the lm_head's hook must run before FSDP2's post-forward frees the gathered weight)."""
    if config.loss_tile_size is not None:
        _tile_loss(parts, config.loss_tile_size)
    if config.mlp_tile_size is not None:
        _tile_mlps(layers, config.mlp_tile_size)


__all__ = ["TiledMLP", "apply_sequence_tiling", "refuse_loss_tiling", "tiled_causal_lm_loss"]
