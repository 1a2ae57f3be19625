"""Expert parallelism (EP) under FSDP2 for mixture-of-experts models, with transformers' own EP machinery.

transformers 5 ships each MoE model's EP plan (`base_model_ep_plan`, e.g. Qwen3-MoE's
`"layers.*.mlp.experts": "ep_dispatch_experts"` with its fused `gate_up_proj`/`down_proj` as
`"grouped_gemm"`) and applies it with `transformers.distributed.expert_parallel.apply_expert_parallelism`:
each expert tensor becomes a `Shard(0)` DTensor on the "ep" mesh (E / ep experts per rank, no
communication: every rank keeps its own rows of the same full weights), and the experts' forward brings each
(token, expert) pair to the expert's rank and the result back: hf_fsdp2's dispatch (sharding/expert_parallel/dispatch.py,
registered with transformers as an `EPImplementation`: fixed-size all-gathers and reduce-scatters), which reads
nothing back to the host per layer, where transformers' `AllToAllEP` reads its split sizes
(`dispatch.set_dispatch` picks that one for a side-by-side). The experts run in transformers' grouped matmul
(`grouped_mm`, its default: one per projection for all local experts).

On top, as `from_pretrained(distributed_config=DistributedConfig(ep_size=...))` composes them
(`transformers/distributed/fsdp.py` `apply_fully_sharded_data_parallelism`, torchtitan's `efsdp`): the
experts module is its own FSDP2 group over the ranks that hold the same experts ("efsdp", shard size / ep),
the rest of each layer is sharded over all of the shard group as without EP. An expert's gradient on a
rank already sums the tokens every rank of its EP group sent it, so the efsdp reduction sums and divides
by the whole data-parallel size (`set_gradient_divide_factor`); FSDP2 would otherwise apply that factor
with a PREMUL_SUM, which gloo rejects, so the reduction is a plain sum divided locally
(`set_force_sum_reduction_for_comms`), as transformers does.

The expert mesh is its own ("efsdp", "ep") mesh over the same ranks (transformers' `TransformersDeviceMesh`
keeps a dense and an expert mesh the same way): ep ranks are neighbours, so one machine's devices exchange
the tokens.

Checkpoints need nothing of their own: an expert tensor is a DTensor on the expert mesh
(`_StridedShard` on efsdp, `Shard` on ep, both on dim 0), whose rows the gather-free writers and readers
already place (tests/test_expert_parallel.py: the files equal stock save_pretrained's, one tensor per
expert, and a training state resumes on plain FSDP and on another ep size).

PEFT LoRA on the linear layers (attention, a shared expert, dense MLPs) trains with the experts frozen
in their own groups; LoRA on the fused experts themselves (`target_parameters`) is applied on each rank's
rows by sharding/expert_parallel/lora.py (EP is applied to the module PEFT's wrappers adapt). Without EP (ep_size 1)
the same LoRA runs inside transformers' grouped matmuls on the whole experts instead of PEFT's fold of every expert's
delta into the weights (sharding/expert_parallel/grouped.py, `apply_grouped_lora`).

Every forward exchanges tokens, so `generate()` keeps the ranks stepping together (`synced_gpus`,
sharding/generation.py). The experts' gradients are on the expert mesh, the rest on the dense one: torch's
`clip_grad_norm_` cannot combine them and refuses by name; `hf_fsdp2.clip_grad_norm_` does (sharding/grad_clip.py).

Not done, refused by name when asked for: a capacity in the model's config (the dispatch is dropless), an experts
implementation not known to skip other ranks' rows (sharding/expert_parallel/dispatch.py), HSDP replicas, tensor or context parallelism, 4-bit
experts, the linears' FP8 (`fp8`), compile, CPU or activation offload, `ignored_modules` that take in experts. The experts'
grouped matmuls in FP8 through torchao: `fp8_experts` (sharding/expert_parallel/low_precision.py).
A model on the meta device (`hf_fsdp2.from_pretrained`) is split the same way before anything is
allocated, and each rank reads its experts' rows only.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ...config import EP_DIM
from ...runtime import collectives
from .. import grad_clip, parallel_plans
from . import dispatch, grouped, lora, low_precision
from ..groups import ignored_parameters
from ..model_parts import ModelParts

EFSDP_DIM = "efsdp"  # the expert mesh's other dimension: the ranks holding the same experts
DISPATCH_STYLE = "ep_dispatch_experts"  # the module whose forward transformers replaces with the token exchange


def resolved_plan(base: nn.Module, shard_size: int, ep_size: int) -> dict[str, str]:
    """The EP plan of `base` (a transformers model) for `ep_size` ranks, one entry per module or parameter (as
    `from_pretrained(distributed_config=...)` resolves it: `_resolve_parallel_plans`), named as they are under
    PEFT's `ParamWrapper`s where LoRA adapts the experts' parameters (sharding/expert_parallel/lora.py)."""
    ep_plan = {} if not getattr(base, "ep_plan", None) else parallel_plans.resolve(
        base, f"`ep_size`={ep_size}: {type(base).__name__} is not a transformers model with an expert-parallel plan.",
        fsdp_size=shard_size, ep_size=ep_size)[1]
    if DISPATCH_STYLE not in ep_plan.values():
        raise ValueError(f"`ep_size`={ep_size}: {type(base).__name__} has no experts to split "
                         f"(its config's base_model_ep_plan names no '{DISPATCH_STYLE}' module); leave ep_size at 1.")
    return lora.plan_through_adapters(base, ep_plan)


def require_available(ep_size: int) -> None:
    """transformers' EP machinery (`transformers.distributed.expert_parallel`, which this module was built on
    with transformers 5.23) is installed, or an error naming the setting and the installed version."""
    try:
        import transformers.distributed.expert_parallel  # noqa: F401
    except ImportError:
        import transformers

        raise ValueError(f"`ep_size`={ep_size} applies the model's EP plan with transformers' expert parallelism "
                         f"(transformers.distributed.expert_parallel), which the installed transformers "
                         f"{transformers.__version__} does not have: install transformers 5.23 or later, or leave "
                         "ep_size at 1.") from None


def check_shard_group(config, shard_size: int) -> None:
    """ep divides the shard group, within one replica (FSDP2Config.mesh_shape's rule for this shard size; an
    ep_size config has no other model-parallel dimension: FSDP2Config refuses ep with tp or cp)."""
    config.replace(shard_size=shard_size, replicate_size=1).mesh_shape(shard_size)


def refuse_unsupported(model: nn.Module, config, mesh: DeviceMesh) -> None:
    """What EP does not cover yet, refused by name before anything changes."""
    from ...quantization import quantized

    require_available(config.ep_size)
    names = mesh.mesh_dim_names or ()
    reason = None
    if len(names) > 1:
        reason = f"the mesh {dict(zip(names, mesh.shape))} (HSDP replicas, tensor or context parallelism)"
    elif quantized.has_quantized_layers(model):
        reason = "4-bit (bitsandbytes) layers"
    else:
        reason = next(iter(config.not_done_with("ep_size")), None)
    if reason:
        raise ValueError(f"`ep_size`={config.ep_size} (expert parallelism) is not done in hf_fsdp2 with {reason}.")
    check_shard_group(config, mesh.size())


def expert_mesh(mesh: DeviceMesh, ep_size: int) -> DeviceMesh:
    """The ("efsdp", "ep") mesh over the ranks of `mesh` (one shard group): ep neighbours exchange tokens.
    Collective: call on every rank."""
    shape = (mesh.size() // ep_size, ep_size)
    override = None
    if mesh.device_type not in collectives.default_group_devices():  # as runtime.distributed.build_mesh
        override = {dim: "gloo" for dim in range(len(shape))}
    return init_device_mesh(mesh.device_type, shape, mesh_dim_names=(EFSDP_DIM, EP_DIM), backend_override=override)


def _batch_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """transformers' `tp_mesh` argument: the ranks that hold the same batch. Without TP each rank holds its own,
    a one-rank mesh dimension (so the dispatch sends every token once)."""
    override = None
    if mesh.device_type not in collectives.default_group_devices():
        override = {0: "gloo", 1: "gloo"}
    return init_device_mesh(mesh.device_type, (mesh.size(), 1), mesh_dim_names=("batch", "tp"),
                            backend_override=override)["tp"]


def apply_expert_parallel(parts: ModelParts, config, mesh: DeviceMesh) -> tuple[list[nn.Module], DeviceMesh]:
    """The model's EP plan applied by transformers on a new expert mesh; the experts modules (each to become
    an FSDP2 group on the mesh's "efsdp" dimension, `shard_experts`) and that mesh. LoRA on the experts'
    parameters then runs on each rank's rows (sharding/expert_parallel/lora.py)."""
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    plan = resolved_plan(parts.base, mesh.size(), config.ep_size)
    names = [name for name, style in plan.items() if style == DISPATCH_STYLE]
    split = {name: parts.base.get_submodule(name) for name in names}
    _refuse_ignored_experts(parts, config, split)
    dispatch.refuse_unsupported(parts.base.config, config.ep_size, split)
    experts_mesh = expert_mesh(mesh, config.ep_size)
    dispatch.prepare(experts_mesh, EP_DIM)
    apply_expert_parallelism(parts.base, experts_mesh[EP_DIM], _batch_mesh(mesh), plan,
                             ep_implementation=dispatch.implementation_name())
    experts = [parts.base.get_submodule(name) for name in names]
    lora.install(experts, [parts.base.get_submodule(lora.unwrapped_name(name)) for name in names],
                        experts_mesh[EP_DIM])
    low_precision.install(experts, config.fp8_experts, mesh.device_type)  # FP8 grouped matmuls (torchao)
    if parts.has_peft:
        lora.refuse_merging(parts.model, parts.base, [lora.unwrapped_name(name) for name in names],
                                   config.ep_size)
    grad_clip.refuse_in_torch()  # torch's clip_grad_norm_ cannot combine the expert and dense meshes' gradients
    return experts, experts_mesh


def apply_grouped_lora(parts: ModelParts) -> list[str]:
    """Without expert parallelism: PEFT LoRA on whole fused experts run inside transformers' grouped matmuls, not
    folded into the weights each forward (sharding/expert_parallel/grouped.py); the experts modules it applies to."""
    return grouped.install(parts.base) if parts.has_peft else []


def apply_low_precision(parts: ModelParts, config, device_type: str) -> list[str]:
    """Without expert parallelism: `fp8_experts` on every experts module, each run through the grouped matmuls of
    sharding/expert_parallel/grouped.py (with EP, `apply_expert_parallel` installs it on the dispatch's experts)."""
    return low_precision.install_whole(parts.base, config.fp8_experts, device_type)


def _refuse_ignored_experts(parts: ModelParts, config, experts: dict[str, nn.Module]) -> None:
    """`ignored_modules` keeps modules out of FSDP2 whole on every rank; experts that EP splits cannot be: refused
    by name before the split (transformers' `apply_expert_parallelism` would split them all the same)."""
    ignored = ignored_parameters(parts.model, config.ignored_modules)
    hit = [name for name, module in experts.items() if any(p in ignored for p in module.parameters())]
    if hit:
        raise ValueError(f"`ignored_modules`={config.ignored_modules!r} takes in the experts {', '.join(hit[:3])}"
                         f"{', ...' if len(hit) > 3 else ''}, which `ep_size`={config.ep_size} splits over the EP "
                         "ranks (expert parallelism cannot leave them whole); keep the experts out of "
                         "`ignored_modules`, or leave ep_size at 1.")


def shard_experts(experts: nn.Module, experts_mesh: DeviceMesh, data_parallel_size: int, fully_shard,
                  **kwargs) -> None:
    """An experts module its own FSDP2 group over "efsdp"; gradients summed there and divided by the whole
    data-parallel size (module docstring)."""
    efsdp = experts_mesh[EFSDP_DIM]
    fully_shard(experts, mesh=efsdp, **kwargs)
    experts.set_gradient_divide_factor(float(data_parallel_size))
    if efsdp.size() > 1:  # with one rank FSDP2 reduces nothing and divides itself; a forced sum would not
        experts.set_force_sum_reduction_for_comms(True)


__all__ = ["DISPATCH_STYLE", "EFSDP_DIM", "EP_DIM", "apply_expert_parallel", "apply_grouped_lora",
           "apply_low_precision", "check_shard_group", "expert_mesh", "refuse_unsupported", "require_available",
           "resolved_plan", "shard_experts"]
