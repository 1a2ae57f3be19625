"""Activations, measured on the meta device: one forward with labels under saved-tensor hooks
(see memory.py's docstring for what is counted)."""

from __future__ import annotations

from typing import Any, Collection, Iterable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..runtime.host_allocator import HEAP_BLOCK_LIMIT
from .memory_report import ActivationMemory


class _FusedAttention(torch.autograd.Function):
    """Shapes-only stand-in for a fused SDPA kernel: saves what flash attention saves (q, k, v, the
    output in (batch, seq, heads, dim) layout, and an fp32 log-sum-exp per query row)."""

    @staticmethod
    def forward(ctx, q, k, v, op_outputs):  # noqa: D401
        out = q.new_empty((*q.shape[:-3], q.shape[-2], q.shape[-3], v.shape[-1])).transpose(-3, -2)
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        if op_outputs is not None:  # the fused kernel's outputs, when the caller's kept ops are recorded
            op_outputs.extend((out, lse))
        return out

    @staticmethod
    def backward(ctx, grad):  # pragma: no cover - the trace never runs backward
        raise NotImplementedError("shape-only attention used by the memory estimate")


class _GroupedMm(torch.autograd.Function):
    """Shapes-only stand-in for `grouped_mm` (mixture-of-experts layers, transformers/integrations/moe.py): its
    meta kernel takes bf16 only, so an fp32 trace could not run it. [S, K] x [E, K, N] -> [S, N], saving both
    inputs as the real op's backward does (the weight is a parameter: not counted)."""

    @staticmethod
    def forward(ctx, x, weight):  # noqa: D401
        ctx.save_for_backward(x, weight)
        return x.new_empty((x.shape[0], weight.shape[-1]))

    @staticmethod
    def backward(ctx, grad):  # pragma: no cover - the trace never runs backward
        raise NotImplementedError("shape-only grouped_mm used by the memory estimate")


_GROUPED_MM = tuple(f for f in (getattr(F, "grouped_mm", None), getattr(torch, "_grouped_mm", None)) if f is not None)


class _FusedAttentionMode(TorchFunctionMode):
    """The trace's stand-ins for fused kernels: SDPA (as flash attention) and MoE's grouped_mm."""

    def __init__(self, op_outputs: list):
        super().__init__()
        self.op_outputs = op_outputs

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention:
            q, k, v = args[:3]
            return _FusedAttention.apply(q, k, v, self.op_outputs)
        if func in _GROUPED_MM:
            return _GroupedMm.apply(args[0], args[1])
        return func(*args, **(kwargs or {}))


class _SavedOpOutputs(TorchDispatchMode):
    """Records the outputs of `kept_ops` (the caller's: planner/memory.py hands the ops a checkpointed layer keeps)."""

    def __init__(self, op_outputs: list, kept_ops: Collection):
        super().__init__()
        self.op_outputs, self.kept_ops = op_outputs, kept_ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if (func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta
                and args[0].dtype == torch.bool):
            # A data-dependent check on the meta trace: with no attention mask and no KV cache (use_cache
            # off, as under the Trainer) transformers asks `.all()` whether position ids show packed
            # sequences (masking_utils.find_packed_sequence_indices). The trace's batch is plain: True.
            return True
        out = func(*args, **(kwargs or {}))
        if func in self.kept_ops:
            self.op_outputs.extend(t for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


def _storage_key(t: torch.Tensor):
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage())


def trace_activations(model: nn.Module, layers: Sequence[nn.Module], batch_size: int, seq_len: int, *,
                      compute_dtype: torch.dtype | None = None, checkpointing: bool = False,
                      head: nn.Module | None = None, kept_ops: Collection = frozenset()) -> ActivationMemory:
    """Run one training forward (with labels) on the meta device and measure what autograd saves.

    `model` must be on the meta device; it is cast in place to `compute_dtype` (as FSDP2's
    `param_dtype` would gather it). `layers` are the decoder layers checkpointing would wrap. `head`
    (the output embedding): what is saved after it ran is the loss's (`loss_saved_bytes`), freed by
    the loss's backward before the head's backward needs its weights again. `kept_ops`: aten ops whose outputs
    each layer's `layer_matmul_bytes` counts (what a checkpointed layer would keep); the fused-attention
    stand-in's outputs are counted with them when any are given (the kernels it stands for are among them).
    """
    if any(not t.is_meta for t in model.parameters()):
        raise ValueError("`trace_activations` needs a model on the meta device (see `build_meta_model`).")
    if compute_dtype is not None:
        for p in model.parameters():
            if p.is_floating_point() and p.dtype != compute_dtype:
                p.data = p.data.to(compute_dtype)
    model.train()
    param_keys = {_storage_key(p) for p in model.parameters()}
    keep: list[torch.Tensor] = []  # holds every seen tensor, so no storage address is reused mid-trace
    sizes: dict[Any, int] = {}
    owner: dict[Any, int] = {}  # storage -> index of the layer that saved it first (-1: outside layers)
    inputs: set = set()
    active: list[int] = []
    after_head: list[bool] = []  # non-empty once the head's forward has returned
    loss_saved: set = set()

    def key_of(t: torch.Tensor):
        keep.append(t)
        k = _storage_key(t)
        sizes.setdefault(k, t.untyped_storage().nbytes())
        return k

    def pack(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, torch.Tensor):
            k = key_of(t)
            if k not in param_keys:
                if k not in owner and after_head:
                    loss_saved.add(k)
                owner.setdefault(k, active[-1] if active else -1)
        return t

    op_outputs: list[torch.Tensor] = []  # since the current layer began: the outputs of `kept_ops`
    matmul_bytes = [0] * len(layers)
    matmul_seen: set = set()

    def pre_hook(index: int):
        def hook(module, args, kwargs):
            op_outputs.clear()
            active.append(index)
            for t in tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor):
                    k = key_of(t)
                    if k not in param_keys:
                        inputs.add(k)
        return hook

    def post_hook(module, args, kwargs, output):
        index = active.pop()
        for t in op_outputs:  # what this layer would keep if checkpointed
            k = key_of(t)
            if k not in matmul_seen:
                matmul_seen.add(k)
                matmul_bytes[index] += sizes[k]
        op_outputs.clear()

    handles = []
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(pre_hook(i), with_kwargs=True))
        handles.append(layer.register_forward_hook(post_hook, with_kwargs=True))
    if head is not None:
        handles.append(head.register_forward_hook(lambda *_: after_head.append(True)))
    ids = torch.zeros(batch_size, seq_len, dtype=torch.long, device="meta")
    try:
        with (torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
              _FusedAttentionMode(op_outputs if kept_ops else None), _SavedOpOutputs(op_outputs, kept_ops)):
            out = model(input_ids=ids, labels=ids)
    finally:
        for h in handles:
            h.remove()
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        owner.setdefault(key_of(logits), -1)

    def total(keys: Iterable) -> int:
        return sum(sizes[k] for k in keys)

    saved = total(owner)
    outside = {k for k, o in owner.items() if o == -1}
    per_layer = [total(k for k, o in owner.items() if o == i and k not in inputs) for i in range(len(layers))]
    largest = max(per_layer, default=0)
    return ActivationMemory(
        batch_size=batch_size, seq_len=seq_len, checkpointing=False, peak_bytes=saved, saved_bytes=saved,
        outside_layers_bytes=total(outside), layer_inputs_bytes=total(inputs - outside),
        loss_saved_bytes=total(loss_saved & outside),
        heap_saved_bytes=sum(sizes[k] for k in owner if sizes[k] < HEAP_BLOCK_LIMIT),
        largest_layer_bytes=largest, layer_bytes=tuple(per_layer), layer_matmul_bytes=tuple(matmul_bytes),
    ).with_checkpointing(checkpointing)


__all__ = ["trace_activations"]
