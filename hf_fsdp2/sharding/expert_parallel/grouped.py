"""PEFT LoRA on whole fused experts (ep_size 1) inside transformers' grouped matmuls, not folded (issue 64).

With LoRA on a fused experts parameter (`target_parameters`, e.g. `mlp.experts.gate_up_proj`), PEFT's `ParamWrapper`
parametrizes the weight for each forward: W + scaling * lhs @ rhs, one `baddbmm` over every expert
(peft/tuners/lora/layer.py `_LoraFactorsProxy`), then transformers' experts read that merged weight. So each step
builds an [experts, out, in] tensor per projection, the grouped matmuls' backward computes its whole gradient (the
size of a full fine-tune's), and two more batched matmuls carry it to the factors: where a LoRA run loses its time.

Where the experts run transformers' default implementation ("grouped_mm", integrations/moe.py
`grouped_mm_experts_forward`) and hf_fsdp2 shards the model without expert parallelism, the outermost `ParamWrapper`
calls `forward` here instead: the (token, expert) pairs sorted by expert on the device as transformers' forward sorts
them (`torch.sort`, `histc` + `cumsum` offsets: no host read), the experts of EP's dispatch
(sharding/expert_parallel/dispatch.py `grouped_experts`) with every expert local and the adapters inside the grouped
matmuls, x @ W + (x @ A) @ (scaling B), then the router's weights and the sum over the top-k as transformers' forward
applies them. PEFT's own factors (sharding/expert_parallel/lora.py `_factors`), cast to W's dtype as PEFT casts them:
the same numbers as PEFT's forward (its fold) up to the order of float additions, no merged weight, no gradient of one.

PEFT's own forward still runs where this one does not apply: adapters merged (`merge_adapter()`: W holds the delta),
mixed-adapter batches (`adapter_names`, which PEFT refuses), another experts implementation (`batched_mm`, `eager`,
...), a weight in a dtype PEFT upcasts for the fold (float8). The experts module's forward is not called here (its own
forward is what this replaces): hooks registered on it alone do not run, those of the MoE block and layer do. Under
expert parallelism (ep_size >= 2) the adapters go inside the dispatch's grouped matmuls by
sharding/expert_parallel/lora.py instead.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from ...runtime import upstream
from . import dispatch, lora

WRAPPER_FORWARD = lora.WRAPPER_FORWARD  # the same seam as under EP: the outermost ParamWrapper's forward
FOLD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # PEFT folds these in W's dtype (others: upcast)


def install(base: nn.Module) -> list[str]:
    """Route LoRA on the whole fused experts of `base` through `forward` (module docstring); the names of the experts
    modules whose outermost `ParamWrapper` now does (transformers experts only: `use_experts_implementation`'s
    classes, which have `has_gate`)."""
    modules = dict(base.named_modules())
    inner = {id(m.base_layer) for m in modules.values() if lora._is_param_wrapper(m)}
    installed = []
    for name, outer in modules.items():
        if not lora._is_param_wrapper(outer) or id(outer) in inner:
            continue
        chain, experts = lora.adapter_chain(outer)
        if not hasattr(experts, "has_gate") or any(w.num_experts != experts.num_experts for w in chain):
            continue
        upstream.wrap_instance_method(outer, "forward", WRAPPER_FORWARD,
                                      lambda original, chain=chain, experts=experts: functools.partial(
                                          _wrapper_forward, original, chain, experts))
        installed.append(name)
    return installed


def runs_here(experts: nn.Module) -> bool:
    """Whether `experts` run transformers' default implementation, grouped_mm (the setting is read at each call:
    `set_experts_implementation` may change it after sharding)."""
    return experts.config._experts_implementation == "grouped_mm"


def _wrapper_forward(peft_forward, chain: list[nn.Module], experts: nn.Module, hidden_states, top_k_index=None,
                     top_k_weights=None, *args, **kwargs):
    """The outermost `ParamWrapper`'s forward: `forward` with the active adapters' factors, or PEFT's own."""
    terms = None
    if (not args and top_k_index is not None and top_k_weights is not None and kwargs.get("adapter_names") is None
            and runs_here(experts) and not any(w.merged for w in chain)):
        terms = _terms(chain, experts)
    if not terms:  # nothing to add, or PEFT's case (merged, mixed batches: refused by it, another implementation)
        return peft_forward(hidden_states, top_k_index, top_k_weights, *args, **kwargs)
    return forward(experts, hidden_states, top_k_index, top_k_weights, terms)


def _terms(chain: list[nn.Module], experts: nn.Module) -> dict | None:
    """{parameter name: [(lhs, rhs, scaling), ...]} of each wrapper's active adapters over all experts, in the weight's
    dtype (PEFT's `get_delta_factors`); None where a weight's dtype is one PEFT upcasts for its fold."""
    terms = {}
    for wrapper in chain:
        if wrapper.disable_adapters:
            continue
        active = [name for name in wrapper.active_adapters if name in wrapper.lora_A]
        if not active:
            continue
        weight = getattr(experts, wrapper.parameter_name)  # FSDP2 gathered it (the layer's pre-forward)
        if weight.dtype not in FOLD_DTYPES:
            return None
        terms[wrapper.parameter_name] = [(*lora._factors(wrapper, adapter, 0, experts.num_experts, weight.dtype),
                                          wrapper.scaling[adapter]) for adapter in active]
    return terms


def forward(experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
            top_k_weights: torch.Tensor, adapters: dict | None = None) -> torch.Tensor:
    """transformers' `grouped_mm_experts_forward` (integrations/moe.py) with LoRA `adapters` inside its grouped
    matmuls: its sort, offsets, router weighting and top-k sum, step for step in its dtypes; the experts'
    projections, gate or activation, biases and post-expert norm by `dispatch.grouped_experts`."""
    num_tokens, hidden_dim = hidden_states.shape
    num_top_k = top_k_index.size(-1)
    sample_weights = top_k_weights.reshape(-1)
    ids, perm = torch.sort(top_k_index.reshape(-1))
    rows = hidden_states[perm // num_top_k]
    # histc, not bincount (no output size read from the device); its CPU kernel takes floats, CUDA's integers
    counts = torch.histc(ids.float() if hidden_states.device.type in ("cpu", "mps") else ids.int(),
                         bins=experts.num_experts, min=0, max=experts.num_experts - 1)
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    out = dispatch.grouped_experts(experts, rows, ids, offsets, adapters)
    weighted = out * sample_weights[perm].unsqueeze(-1)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.size(0), device=perm.device)
    # back in (token, top-k) order, summed over the top-k as transformers sums it (reshape + sum, deterministic)
    return weighted[inverse].view(num_tokens, num_top_k, hidden_dim).sum(dim=1).to(hidden_states.dtype)


__all__ = ["FOLD_DTYPES", "forward", "install", "runs_here"]
