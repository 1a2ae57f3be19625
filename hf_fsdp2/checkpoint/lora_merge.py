"""Merged-LoRA deltas: each adapter's W delta as a function of a row range, so that every rank
computes only the rows (or experts) it holds (checkpoint/export_plan.py adds them to the base rows).

The LoRA factors are small (rank r), so each is all-gathered once; the base weights never are. Each
delta follows PEFT's own `get_delta_weight` of the layer type (peft/tuners/lora/layer.py), restricted
to a row range:
- `Linear`: delta = B @ A * s, transposed for `fan_in_fan_out` (GPT-2's `Conv1D` stores [in, out]);
- `Embedding`: delta = (B @ A)^T * s (PEFT's lora_embedding_A is [r, num_embeddings]);
- `Conv1d/2d/3d`: PEFT's conv of A^T with B (a matmul for 1x1 kernels); row o needs only B[o];
- `ParamWrapper` (`target_parameters`, e.g. fused MoE experts [E, ., .]): per expert
  einsum("o r e, e r i -> e i o" or "-> e o i") of B viewed [out, r, E] and A viewed [E, r, in];
  FSDP2's dim-0 shards of such a parameter are whole experts.
Other types (DoRA, multi-head attention) are refused by name: save the adapter instead.
Each delta is a new tensor, scaled in place (the same values as PEFT's `(B @ A) * scaling`, one allocation
fewer): export_plan.py adds the base rows into it in place.
"""

from __future__ import annotations

import re
from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..quantization import quantized

RowsDelta = Callable[[int, int], torch.Tensor]  # (first row, stop row) -> a new float32 tensor: the delta of those rows


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float()


class LinearRowsDelta:
    """A `Linear`'s delta by rows, B[lo:hi] @ A * s, which `add_into` adds to fp32 rows in one BLAS call
    (addmm: alpha = s), the pass over the rows a separate product, scale and add would make three times."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, scaling: float):
        self.a, self.b, self.scaling = a, b, scaling

    def __call__(self, lo: int, hi: int) -> torch.Tensor:
        return (self.b[lo:hi] @ self.a).mul_(self.scaling)

    def add_into(self, rows32: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        return rows32.addmm_(self.b[lo:hi].to(rows32.device), self.a.to(rows32.device), alpha=self.scaling)


def _delta_of(module: nn.Module, adapter: str) -> tuple[torch.Tensor, RowsDelta]:
    """(base parameter, its delta by rows) for one LoRA layer. Collective: gathers the factors."""
    from peft.tuners.lora import Embedding, Linear, ParamWrapper
    from peft.tuners.lora.layer import _ConvNd

    kind = type(module).__name__
    if module.use_dora.get(adapter, False):
        raise NotImplementedError(f"merging a DoRA layer ({kind}) is not supported; save the adapter instead "
                                  "(merge_adapters=False).")
    scaling = module.scaling[adapter]
    if isinstance(module, ParamWrapper):
        a, b = _full(module.lora_A[adapter].weight), _full(module.lora_B[adapter].weight)
        if module.num_experts == 1:
            return module.get_param(), lambda lo, hi: (b[lo:hi] @ a).mul_(scaling)
        experts = module.num_experts
        a3, b3 = a.reshape(experts, -1, a.shape[-1]), b.reshape(b.shape[0], -1, experts)
        # PEFT swaps in/out for [experts, out, in] parameters (`_did_swap_in_out_features`); PEFT < 0.19 never
        # swaps (no such attribute) and its get_delta_weight is always "-> e i o".
        swapped = getattr(module, "_did_swap_in_out_features", False)
        equation = "o r e, e r i -> e o i" if swapped else "o r e, e r i -> e i o"
        return module.get_param(), lambda lo, hi: torch.einsum(equation, b3[:, :, lo:hi], a3[lo:hi]).mul_(scaling)
    if isinstance(module, Linear) or quantized.is_prepared(module.get_base_layer()):
        # PEFT's 4-bit LoRA layer (peft/tuners/lora/bnb.py: Linear4bit.get_delta_weight) is Linear's delta.
        a, b = _full(module.lora_A[adapter].weight), _full(module.lora_B[adapter].weight)
        if module.fan_in_fan_out:  # weight is [in, out]: its rows are A's columns
            return module.get_base_layer().weight, lambda lo, hi: (b @ a[:, lo:hi]).T.mul_(scaling)
        return module.get_base_layer().weight, LinearRowsDelta(a, b, scaling)
    if isinstance(module, _ConvNd):  # delta row o (out channel) needs B[o] only
        a, b = _full(module.lora_A[adapter].weight), _full(module.lora_B[adapter].weight)
        weight = module.get_base_layer().weight
        if weight.shape[2:4] == (1, 1):
            return weight, lambda lo, hi: (b[lo:hi].squeeze(3).squeeze(2) @ a.squeeze(3).squeeze(2))[
                :, :, None, None] * scaling
        if module.get_base_layer().groups > 1:  # PEFT's grouped form is not row-separable: whole delta, sliced
            delta = module.conv_fn(a.transpose(0, 1), b) * scaling
            return weight, lambda lo, hi: delta[lo:hi].clone()  # a fresh tensor, as every delta here: added to in place
        return weight, lambda lo, hi: module.conv_fn(a.transpose(0, 1), b[lo:hi]).transpose(0, 1) * scaling
    if isinstance(module, Embedding):
        a, b = _full(module.lora_embedding_A[adapter]), _full(module.lora_embedding_B[adapter])
        return module.get_base_layer().weight, lambda lo, hi: (b @ a[:, lo:hi]).T * scaling
    raise NotImplementedError(f"merging LoRA into a {kind} layer is not supported gather-free; save the adapter "
                              "instead (merge_adapters=False).")


def base_model_name(name: str) -> str | None:
    """A PeftModel (or its base model's) parameter name -> the name without PEFT's wrapping, or None
    for adapter-only tensors."""
    name = name.removeprefix("base_model.model.")
    if ".lora_" in name or name.startswith("lora_") or ".original_module." in name:
        return None
    name = re.sub(r"(\.base_layer)+\.", ".", name)  # nested: a ParamWrapper wraps another per parameter
    return name.replace(".modules_to_save.default.", ".")


def adapter_deltas(model: nn.Module, adapter: str) -> dict[int, RowsDelta]:
    """id(base weight) -> its delta by rows, for every LoRA layer holding `adapter`.
    Collective: all-gathers each layer's LoRA factors, in module order; call on every rank."""
    from peft.tuners.lora import LoraLayer

    deltas: dict[int, RowsDelta] = {}
    for module in model.modules():
        if isinstance(module, LoraLayer) and (adapter in module.lora_A or adapter in module.lora_embedding_A):
            weight, delta = _delta_of(module, adapter)
            deltas[id(weight)] = delta
    return deltas
