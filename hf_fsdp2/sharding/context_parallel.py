"""Context parallelism (CP): each rank of the "cp" mesh dimension holds a slice of every sequence.

The parts are torch's and Accelerate's; this module only fills the one gap on the CPU:
- Accelerate's `maybe_context_parallel` enters torch's `context_parallel(mesh["cp"])`, which splits
  the buffers it is given along the sequence (head-tail load balanced for causal attention) and
  routes SDPA's fused kernels to torch's ring attention (`_templated_ring_attention`): K/V blocks
  pass around the ring, partial outputs merge by their log-sum-exp. Accelerate drops the attention
  mask for `is_causal=True` (`_attach_context_parallel_hooks`).
- FSDP2 shards over the flattened "dp_shard_cp" dimension (engine.py), so each parameter's gradient
  is averaged over the CP ranks too, as Accelerate's own FSDP2 path does.
- torch's ring attention has handlers for the CUDA kernels only (flash, efficient, cuDNN); on a CPU
  SDPA runs `_scaled_dot_product_flash_attention_for_cpu`, for which DTensor has no strategy, so CP
  fails there. `enable_cpu_ring_attention` registers the same ring attention, through torch's own
  templated forward and backward, for that kernel: CP runs (and is tested) on CPU with gloo as on GPUs.
- With Ulysses (sp within a machine, cp across) the engine hands sequence_parallel.py `load_balanced_order` and
  `ring_attention`: the sequence is laid out as torch's ring expects it, each cp rank's part split over its sp
  ranks, and the attention of an sp group's part (after Ulysses' all-to-all: all its tokens, 1/sp of the heads)
  runs torch's ring over the cp ranks directly, outside `context_parallel` (`_RingAttention`).
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from ..config import CP_DIM
from ..runtime import collectives, upstream
from .model_parts import ModelParts

_CP_HANDLERS = "torch.distributed.tensor.experimental._context_parallel._attention.custom_ops"
_SEQ_DIM = 2  # SDPA's [batch, heads, sequence, head_dim]


def _cp():
    from torch.distributed.tensor.experimental._context_parallel import _attention

    return _attention


def _bound(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> dict:
    """The op's arguments by name, defaults filled in (the schema's)."""
    values = {}
    for i, argument in enumerate(op._schema.arguments):
        if i < len(args):
            values[argument.name] = args[i]
        elif argument.name in kwargs:
            values[argument.name] = kwargs[argument.name]
        elif argument.has_default_value():
            values[argument.name] = argument.default_value
    return values


def _spec_like(local: torch.Tensor, mesh) -> DTensorSpec:
    """The spec of a tensor sharded on the sequence dimension over the CP mesh, from its local block."""
    shape = list(local.shape)
    shape[_SEQ_DIM] *= mesh.size()
    stride = torch.empty(shape, device="meta").stride()
    return DTensorSpec(mesh, (Shard(_SEQ_DIM),), tensor_meta=TensorMeta(torch.Size(shape), stride, local.dtype))


def _refuse(values: dict) -> None:
    if values.get("attn_mask") is not None:
        raise NotImplementedError("context parallelism runs causal attention without a mask (Accelerate drops the "
                                  "attention mask for is_causal=True); an explicit SDPA mask is not supported.")
    if values.get("dropout_p", 0.0):
        raise NotImplementedError("context parallelism with attention dropout is not supported by torch's ring "
                                  "attention; set the model's attention_dropout to 0.")


def _cpu_flash_forward(op_call, args, kwargs):
    op_info = DTensor._op_dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    mesh = op_info.compute_mesh
    values = _bound(op_call, op_info.local_args, op_info.local_kwargs)
    _refuse(values)
    out, lse = _cp()._templated_ring_attention(
        mesh.get_group(), _SEQ_DIM, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
        query=values["query"], key=values["key"], value=values["value"], is_causal=values["is_causal"],
        scale=values.get("scale"))
    return DTensor._op_dispatcher.wrap((out, lse), (_spec_like(out, mesh), _spec_like(lse, mesh)))


def _cpu_flash_backward(op_call, args, kwargs):
    op_info = DTensor._op_dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    mesh = op_info.compute_mesh
    values = _bound(op_call, op_info.local_args, op_info.local_kwargs)
    _refuse(values)
    grads = _cp()._templated_ring_attention_backward(
        mesh.get_group(), _SEQ_DIM, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        grad_out=values["grad_out"], grad_out_name="grad_out", query=values["query"], key=values["key"],
        value=values["value"], out=values["out"], logsumexp=values["logsumexp"], is_causal=values["is_causal"],
        dropout_p=0.0, scale=values.get("scale"))
    grads = grads[:3]
    return DTensor._op_dispatcher.wrap(tuple(grads), tuple(_spec_like(g, mesh) for g in grads))


def enable_cpu_ring_attention() -> None:
    """Add the CPU kernel's ring attention to torch's CP handlers (which `context_parallel` installs
    on entry and removes on exit; idempotent). Safe to call without CP: outside `context_parallel`
    the handlers are not installed."""
    aten = torch.ops.aten
    upstream.add_entries(_CP_HANDLERS, {
        aten._scaled_dot_product_flash_attention_for_cpu.default: _cpu_flash_forward,
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _cpu_flash_backward,
    })


def load_balanced_order(length: int, cp_size: int, device=None) -> torch.Tensor:
    """The sequence's token indices in the order torch's ring attention holds them over `cp_size` ranks, rank after
    rank: `context_parallel`'s default head-tail load balancing (torch's `_HeadTailLoadBalancer`) gives cp rank r
    chunks r and 2 cp_size - 1 - r of 2 cp_size equal chunks, the layout `_templated_ring_attention` computes
    causal attention on (its `enable_load_balance`, on by default: `_require_load_balance`)."""
    if length % (2 * cp_size):
        raise ValueError(f"cp_size={cp_size}: the sequence length {length} must be a multiple of 2 x cp_size = "
                         f"{2 * cp_size} (load-balanced causal ring attention splits it into 2 x cp_size chunks); "
                         f"pad the batch (e.g. pad_to_multiple_of) with labels -100.")
    chunks = torch.arange(length, device=device).view(2 * cp_size, length // (2 * cp_size))
    return torch.cat([torch.cat((chunks[r], chunks[2 * cp_size - 1 - r])) for r in range(cp_size)])


def _require_load_balance() -> None:
    if not _cp()._cp_options.enable_load_balance:  # only torch's context_parallel(load_balancer=None) turns it off
        raise RuntimeError("context parallelism with Ulysses lays sequences out head-tail load balanced, but torch's "
                           "ring attention has load balancing off (inside context_parallel without a load balancer?); "
                           "run the training step outside torch's context_parallel.")


def _kernels(device: torch.device) -> tuple:
    """(forward op, its extra arguments, backward op, the name of its output gradient, its extra arguments) of the
    SDPA kernel the ring runs on `device`, as torch's own ring handlers call them (_attention.py's
    _scaled_dot_product_ring_*): the CPU's flash kernel, or the memory-efficient kernel on GPUs (fp32 and bf16)."""
    aten = torch.ops.aten
    if device.type == "cpu":
        return (aten._scaled_dot_product_flash_attention_for_cpu, {"dropout_p": 0.0},
                aten._scaled_dot_product_flash_attention_for_cpu_backward.default, "grad_out", {"dropout_p": 0.0})
    return (aten._scaled_dot_product_efficient_attention,
            {"attn_bias": None, "compute_log_sumexp": True, "dropout_p": 0.0},
            aten._scaled_dot_product_efficient_attention_backward.default, "grad_out_",
            {"attn_bias": None, "dropout_p": 0.0, "grad_input_mask": (True, True, True, False)})


def _grouped(forward_op, backward_op, groups: int):
    """The kernels on key/value heads shared by `groups` query heads each: the ring passes the key/value heads
    themselves (1/groups of the bytes), each step repeats them for the kernel (transformers' repeat_kv) and sums
    their gradients back over the query heads that shared them."""
    if groups == 1:
        return forward_op, backward_op

    def repeat(t: torch.Tensor) -> torch.Tensor:
        return t.repeat_interleave(groups, dim=1)

    def forward(query, key, value, **kwargs):
        return forward_op(query, repeat(key), repeat(value), **kwargs)

    def backward(*, key, value, **kwargs):
        grad_query, grad_key, grad_value, *rest = backward_op(key=repeat(key), value=repeat(value), **kwargs)
        fold = lambda g: g.unflatten(1, (key.shape[1], groups)).sum(2)  # noqa: E731
        return grad_query, fold(grad_key), fold(grad_value), *rest
    return forward, backward


class _RingAttention(torch.autograd.Function):
    """Causal attention of [b, heads, part, d] tensors, each cp rank's part laid out by `load_balanced_order`: torch's
    ring forward and backward (`_templated_ring_attention` and `_templated_ring_attention_backward`) called on plain
    tensors, as the DTensor handlers `context_parallel` installs call them on the local blocks. Key and value may
    have fewer heads than the query (grouped: `_grouped`)."""

    @staticmethod
    def forward(ctx, query, key, value, group, scale):
        forward_op, forward_args, *_ = _kernels(query.device)
        forward_op, _ = _grouped(forward_op, None, query.shape[1] // key.shape[1])
        out, lse, *rest = _cp()._templated_ring_attention(group, _SEQ_DIM, forward_op, query=query, key=key,
                                                          value=value, is_causal=True, scale=scale, **forward_args)
        ctx.group, ctx.scale = group, scale
        ctx.save_for_backward(query, key, value, out, lse, *rest[:2])  # the GPU kernel's philox seed and offset
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse, *rest = ctx.saved_tensors
        _, _, backward_op, grad_name, backward_args = _kernels(query.device)
        _, backward_op = _grouped(None, backward_op, query.shape[1] // key.shape[1])
        if rest:
            backward_args = {**backward_args, "philox_seed": rest[0], "philox_offset": rest[1]}
        grads = _cp()._templated_ring_attention_backward(
            ctx.group, _SEQ_DIM, backward_op, grad_out=grad_out.contiguous(), grad_out_name=grad_name, query=query,
            key=key, value=value, out=out, logsumexp=lse, is_causal=True, scale=ctx.scale, **backward_args)
        return grads[0], grads[1], grads[2], None, None


def ring_attention(group) -> Callable:
    """Causal attention over the cp ranks of `group` of an sp group's part of the sequence, laid out by
    `load_balanced_order`: (query [b, heads, part, d], key, value [b, heads / groups, part, d]; scale) -> out
    [b, heads, part, d]."""
    def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale) -> torch.Tensor:
        _require_load_balance()
        return _RingAttention.apply(query.contiguous(), key.contiguous(), value.contiguous(), group, scale)
    return attention


def context_parallel_active() -> bool:
    """Whether torch's CP dispatcher is on (inside `context_parallel` / `maybe_context_parallel`)."""
    return torch.ops.aten._scaled_dot_product_flash_attention.default in DTensor._op_dispatcher._custom_op_handlers


def require_context_parallel(parts: ModelParts, cp_size: int) -> None:
    """A training forward outside `maybe_context_parallel` would run every CP rank on whole sequences: a
    silent data-parallel run with `cp_size` set. Refused by name at that forward (evaluation and
    generation without CP are correct, each CP rank computing the same thing, and pass)."""
    def check(module: nn.Module, args, kwargs) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        if not context_parallel_active():
            raise RuntimeError(
                f"parallelism_config cp_size={cp_size}, but this training forward runs outside "
                "`accelerator.maybe_context_parallel(buffers=[input_ids, labels, position_ids, ...], "
                "buffer_seq_dims=[1, ...])`: every CP rank would compute whole sequences. Wrap the forward and "
                "backward in it (the Trainer does), or set parallelism_config_cp_size to 1.")
        refuse_padding(_argument(module, parts.base, "attention_mask", args, kwargs), cp_size)

    parts.model.register_forward_pre_hook(check, with_kwargs=True)


def _argument(module: nn.Module, base: nn.Module, name: str, args: tuple, kwargs: dict):
    """The forward's argument `name` however it was passed: `model(input_ids, attention_mask)` is LlamaForCausalLM's
    signature too, so a positional mask must be seen as a keyword one is. A PeftModel's forward takes `*args` and
    hands them to the transformers model's (`base`): its signature names them. Arguments that bind to neither are
    the forward's own error to raise."""
    for forward in (module.forward, base.forward):
        try:
            bound = inspect.signature(forward).bind_partial(*args, **kwargs)
        except (TypeError, ValueError):
            continue
        if name in bound.arguments:
            return bound.arguments[name]
    return kwargs.get(name)


def refuse_padding(mask, cp_size: int) -> None:
    """Torch's ring attention runs causal attention with no mask, and Accelerate drops the attention mask
    before SDPA under CP: a padded batch would train as if its padding were tokens, silently (issue 48).
    A [batch, seq] mask with a 0 anywhere, on any rank (agreed over ranks: CP ranks see different slices),
    or a mask of another shape (which cannot be read as padding), is refused by name. Collective: every
    rank runs the training forward."""
    if mask is None:
        padded = 0
    else:
        local = mask.to_local() if isinstance(mask, DTensor) else mask
        padded = int(local.dim() != 2 or not bool((local != 0).all()))
    if collectives.all_reduce_int(padded, "max", purpose="cp-padding"):
        raise ValueError(
            f"parallelism_config cp_size={cp_size}: the batch's attention_mask marks padding (or is not a "
            "[batch, seq] mask), and context parallelism attends without a mask (torch's ring attention; Accelerate "
            "drops the mask), so padding would be trained as tokens. Pack sequences without padding (e.g. "
            "DataCollatorWithFlattening, or padding with labels -100 and no attention_mask), or set cp_size to 1.")


def refuse_other_backend(parallelism_config) -> None:
    """Accelerate's parallelism_config asking for a CP backend other than torch's, refused by name at prepare."""
    pc = parallelism_config
    if (getattr(pc, "cp_size", 1) or 1) > 1 and getattr(pc, "cp_backend", "torch") != "torch":
        raise ValueError(f"parallelism_config cp_backend={pc.cp_backend!r}: hf_fsdp2 runs context parallelism "
                         "with torch's ring attention only; set parallelism_config_cp_backend: torch.")


def refuse_another_mesh(mesh, cp_size: int) -> None:
    """A model sharded before `prepare` keeps its mesh (integrations/presharded.py, through the engine): the
    context parallelism Accelerate's settings ask for (parallelism_config cp_size) must be its "cp" dimension."""
    names = mesh.mesh_dim_names or () if mesh is not None else ()
    model_cp = mesh[CP_DIM].size() if CP_DIM in names else 1
    if model_cp != cp_size:
        raise ValueError(
            f"prepare: the Accelerate settings ask for context parallelism over {cp_size} ranks (parallelism_config "
            f"cp_size) but the model was sharded before prepare on a mesh with {model_cp}; load it on Accelerate's "
            "mesh: hf_fsdp2.from_pretrained(..., hf_fsdp2.accelerator_config(accelerator), "
            "mesh=accelerator.torch_device_mesh).")


def checked_context(original, cp_size: int):
    """Accelerate's `maybe_context_parallel` context (torch's `context_parallel`, `original`), refusing by name
    the buffers it cannot split evenly over the cp ranks (`check_accelerate_context` wraps the accelerator's)."""
    def context(buffers=None, buffer_seq_dims=None, no_restore_buffers=None, **kwargs):
        lengths = {int(b.shape[d]) for b, d in zip(buffers or [], buffer_seq_dims or [])}
        if len(lengths) > 1 or any(length % cp_size for length in lengths):
            raise ValueError(f"maybe_context_parallel: sequence lengths {sorted(lengths)} along buffer_seq_dims must be "
                             f"one length that parallelism_config cp_size={cp_size} divides (2 x cp_size = "
                             f"{2 * cp_size} for load-balanced causal attention); pad the batch (e.g. "
                             f"pad_to_multiple_of={2 * cp_size}).")
        return original(buffers=buffers, buffer_seq_dims=buffer_seq_dims, no_restore_buffers=no_restore_buffers,
                        **kwargs)
    return context


def check_accelerate_context(accelerator, cp_size: int) -> None:
    """The prepared accelerator's CP context (what `maybe_context_parallel` enters, set by Accelerate's
    `_prepare_cp`) wrapped with `checked_context`, on this accelerator only (runtime/upstream.py's seam)."""
    if getattr(accelerator, "_cp_context", None) is not None:
        upstream.wrap_instance_method(accelerator, "_cp_context", "accelerate.accelerator.Accelerator._prepare_cp",
                                      lambda original: checked_context(original, cp_size))
