"""PEFT LoRA on fused experts (`target_parameters`, e.g. `mlp.experts.gate_up_proj`) under expert parallelism.

PEFT adapts a parameter with a `ParamWrapper` around the module that owns it (one per parameter, nested), whose
forward registers a parametrization so that the module reads `W + scaling * lhs @ rhs` (peft/tuners/lora/layer.py
`ParamWrapper._activate_lora`, `_LoraFactorsProxy`: one `baddbmm` over the experts). Under EP that cannot run as
it is: the experts' weights are `Shard(0)` DTensors on the "ep" mesh that transformers' EP forward swaps for their
local rows (`_use_local_dtensor_params`, which sees no parametrized parameter), while PEFT's factors span every
expert of the model.

So, for each experts module transformers split:
- the experts module (not PEFT's wrapper) is what EP is applied to and what becomes the "efsdp" FSDP2 group
  (`plan_through_adapters`, `innermost`), so FSDP2 gathers its rows before anything reads them;
- the outermost `ParamWrapper`'s forward calls the experts module directly (no parametrization);
- the experts' forward (transformers' EP forward) gets PEFT's own factors (`get_delta_factors`) sliced to the
  experts this rank holds: where hf_fsdp2's dispatch runs the experts in its grouped matmuls (transformers'
  default `grouped_mm`), the adapters run inside them, x @ W + scaling * (x @ A) @ B over the same groups
  (sharding/expert_parallel/dispatch.py `grouped_experts`: no merged weight, no gradient of one, none to a frozen W);
  otherwise (transformers' AllToAllEP, batched_mm) each adapted parameter is replaced, for the call, by its local
  rows plus their delta: the same `baddbmm` PEFT folds.

The adapters (`lora_A`/`lora_B`, small: r x E rows) stay whole in their layer's group, sharded over every rank.
A rank's gradient holds only its experts' slices, from every token its EP group sent them; FSDP2's mean over all
ranks sums each slice over the ranks that hold its expert: the one-process gradient.

Not done, refused by name: merged adapters (`merge_adapter()`, `merge_and_unload()`: refused before PEFT changes
a module, `refuse_merging`) on split experts, mixed-adapter batches (PEFT refuses those for `ParamWrapper` itself).
`hf_fsdp2.save_pretrained(model, dir, merge_adapters=True)` writes the merged model, gather-free.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ...runtime import upstream
from . import dispatch

WRAPPER_FORWARD = "peft.tuners.lora.layer.ParamWrapper.forward"
EP_FORWARD = "transformers.distributed.expert_parallel.EpDispatchExpertsParallel.install_forward"
PARAMETERS = "torch.nn.Module._parameters"
MERGES = {"merge_and_unload": "peft.tuners.tuners_utils.BaseTuner.merge_and_unload",
          "merge_adapter": "peft.tuners.tuners_utils.BaseTuner.merge_adapter"}


def _is_param_wrapper(module: nn.Module) -> bool:
    return type(module).__name__ == "ParamWrapper" and hasattr(module, "parameter_name")


def adapter_chain(module: nn.Module) -> tuple[list[nn.Module], nn.Module]:
    """PEFT's `ParamWrapper`s nested around `module` (outermost first) and the module they adapt."""
    chain = []
    while _is_param_wrapper(module):
        chain.append(module)
        module = module.base_layer
    return chain, module


def unwrapped_name(name: str) -> str:
    """The name of the outermost wrapper of the module named `name` (`plan_through_adapters` appends one
    `.base_layer` per `ParamWrapper`): the name the model's plans use."""
    while name.endswith(".base_layer"):
        name = name.removesuffix(".base_layer")
    return name


def plan_through_adapters(base: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """`plan` (transformers' resolved EP plan of `base`) with each module PEFT's `ParamWrapper`s adapt named as it
    is under them (`...experts.base_layer.base_layer`), its parameters listed before it as transformers lists them
    (they are split first: the module's EP forward reads the local expert count). transformers' expansion
    (`_expand_parallel_plan`) walks the wrapped names, so it finds the module's rule on the outermost wrapper and
    none for the parameters: their rules are looked up as transformers does (`_get_parameter_plan`) under the
    names without the wrappers."""
    from transformers.distributed.parallel_utils import _get_parameter_plan

    modules = dict(base.named_modules())
    out = {}
    for name, style in plan.items():
        chain, inner = adapter_chain(modules[name]) if name in modules else ([], None)
        if not chain:
            out[name] = style
            continue
        inner_name = name + ".base_layer" * len(chain)
        for param_name, _ in inner.named_parameters(recurse=False):
            param_style = _get_parameter_plan(f"{name}.{param_name}", base.ep_plan, is_weight=True)
            if param_style is not None:
                out[f"{inner_name}.{param_name}"] = param_style
        out[inner_name] = style
    return out


def install(experts_modules: list[nn.Module], wrappers: list[nn.Module], ep_mesh) -> None:
    """Route the LoRA of each wrapped experts module through its local rows (module docstring). `wrappers[i]` is
    the module the model calls in place of `experts_modules[i]` (itself when PEFT did not wrap it)."""
    ep_rank = ep_mesh.get_local_rank()
    for experts, outer in zip(experts_modules, wrappers):
        chain, inner = adapter_chain(outer)
        if not chain:
            continue
        assert inner is experts, (outer, experts)
        upstream.wrap_instance_method(outer, "forward", WRAPPER_FORWARD,
                                      lambda original, experts=experts: functools.partial(_call_experts, experts))
        upstream.wrap_instance_method(experts, "forward", EP_FORWARD,
                                      lambda ep_forward, chain=chain, experts=experts: functools.partial(
                                          _with_local_adapters, chain, experts, ep_rank, ep_forward))


def refuse_merging(peft_model: nn.Module, base: nn.Module, experts_names: list[str], ep_size: int) -> None:
    """PEFT's merges (`merge_and_unload()`, `merge_adapter()`, reached through the `PeftModel` from its tuner)
    refused by name on a model whose split experts carry LoRA: each rank holds only its experts' rows, which
    PEFT's merge adds a whole-model delta to (a DTensor mesh error). Refused before PEFT changes anything: it
    merges and unloads module by module, a layer's attention before its experts."""
    adapted = [name for name in experts_names if adapter_chain(base.get_submodule(name))[0]]
    if not adapted:
        return
    for method, target in MERGES.items():
        upstream.wrap_instance_method(peft_model.base_model, method, target,
                                      lambda original, method=method: functools.partial(
                                          _refuse_merge, method, adapted, ep_size))


def _refuse_merge(method: str, adapted: list[str], ep_size: int, *args, **kwargs):
    raise ValueError(f"`{method}()` with LoRA on experts that expert parallelism split (`ep_size`={ep_size}: "
                     f"{', '.join(adapted[:2])}{', ...' if len(adapted) > 2 else ''}) is not done in hf_fsdp2: each "
                     "rank holds only its own experts' rows. Write the merged model with "
                     "hf_fsdp2.save_pretrained(model, directory, merge_adapters=True) (gather-free; it loads with "
                     "transformers' from_pretrained), and keep the adapters unmerged here.")


def _call_experts(experts: nn.Module, x, *args, **kwargs):
    """The outermost `ParamWrapper`'s forward: the experts module, which applies the adapters itself."""
    if kwargs.get("adapter_names") is not None:  # as PEFT's ParamWrapper refuses them
        raise ValueError("LoRA on fused experts does not support mixed adapter batches (`adapter_names`).")
    kwargs.pop("adapter_names", None)
    return experts(x, *args, **kwargs)


def _active(wrapper: nn.Module) -> list[str]:
    if wrapper.disable_adapters:
        return []
    if wrapper.merged:
        raise ValueError(f"LoRA merged into split experts ({wrapper.parameter_name}, `merge_adapter()`) is not done "
                         "in hf_fsdp2 under expert parallelism (ep_size > 1); unmerge it, or save with "
                         "save_pretrained(..., merge_adapters=True).")
    return [name for name in wrapper.active_adapters if name in wrapper.lora_A]


def _factors(wrapper: nn.Module, adapter: str, first: int, count: int, dtype: torch.dtype):
    """(lhs, rhs) of experts first..first+count, such that their delta is scaling * lhs @ rhs: PEFT's
    `ParamWrapper.get_delta_factors` (peft >= 0.21) restricted to those experts. lora_A is [E*r, in] (expert
    major), lora_B [out, r*E] (expert minor); PEFT swaps in/out for [experts, out, in] parameters
    (`_did_swap_in_out_features`, absent before peft 0.19, which never swaps)."""
    experts = wrapper.num_experts
    a = wrapper.lora_A[adapter].weight
    b = wrapper.lora_B[adapter].weight
    a3 = a.reshape(experts, -1, a.shape[-1])[first:first + count]  # (experts, r, in)
    b3 = b.reshape(b.shape[0], -1, experts).permute(2, 0, 1)[first:first + count]  # (experts, out, r)
    if getattr(wrapper, "_did_swap_in_out_features", False):
        return b3.to(dtype), a3.to(dtype)
    return a3.transpose(-2, -1).to(dtype), b3.transpose(-2, -1).to(dtype)


def _local_terms(chain: list[nn.Module], experts: nn.Module, ep_rank: int) -> dict:
    """{parameter name: (its local rows, [(lhs, rhs, scaling) of each active adapter, sliced to this rank's experts])}
    for the adapted parameters of `experts`."""
    terms = {}
    for wrapper in chain:
        adapters = _active(wrapper)
        if not adapters:
            continue
        weight = experts._parameters[wrapper.parameter_name]  # FSDP2 gathered it (experts' pre-forward): Shard(0)
        rows = weight.to_local() if isinstance(weight, DTensor) else weight
        first = ep_rank * rows.shape[0]  # Shard(0), E divisible by ep: rank i holds experts [i*E/ep, ...)
        terms[wrapper.parameter_name] = rows, [(*_factors(wrapper, adapter, first, rows.shape[0], rows.dtype),
                                               wrapper.scaling[adapter]) for adapter in adapters]
    return terms


def _with_local_adapters(chain: list[nn.Module], experts: nn.Module, ep_rank: int, ep_forward, *args, **kwargs):
    """transformers' EP forward with this rank's share of the adapters: inside hf_fsdp2's grouped matmuls where its
    dispatch runs the experts (`dispatch.adapters`: x @ W + scaling * (x @ A) @ B, no merged weight), else
    each adapted parameter, for this call, its local rows plus their delta (PEFT's fold)."""
    terms = _local_terms(chain, experts, ep_rank)
    if not terms:
        return ep_forward(*args, **kwargs)
    if dispatch.takes_adapters(experts):
        with dispatch.adapters(experts, {name: factors for name, (_, factors) in terms.items()}):
            return ep_forward(*args, **kwargs)
    swapped = {}
    try:
        for name, (rows, factors) in terms.items():
            for lhs, rhs, scaling in factors:
                with torch.autocast(device_type=rows.device.type, enabled=False):  # PEFT's fold, in W's dtype
                    rows = torch.baddbmm(rows, lhs, rhs, alpha=scaling)
            swapped[name] = experts._parameters[name]
            upstream.set_entry(experts, "_parameters", name, rows, PARAMETERS)
        return ep_forward(*args, **kwargs)
    finally:
        for name, weight in swapped.items():  # back before FSDP2's post-forward reshards what it gathered
            upstream.set_entry(experts, "_parameters", name, weight, PARAMETERS)


__all__ = ["adapter_chain", "install", "plan_through_adapters", "refuse_merging", "unwrapped_name"]
