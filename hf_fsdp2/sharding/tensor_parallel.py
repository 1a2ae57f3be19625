"""Tensor parallelism (TP) under FSDP2, with transformers' own TP machinery.

transformers 5 ships each model's TP plan (`base_model_tp_plan`: colwise/rowwise linears, a rowwise
embedding, ...) and applies it with `transformers.distributed.tensor_parallel.apply_tensor_parallelism`
(parameters become DTensors on the "tp" mesh, forward hooks redistribute activations). `shard_model`
with `tp_size` > 1 resolves the plan the way `from_pretrained(distributed_config=...)` does
(`PreTrainedModel._resolve_parallel_plans`), applies it on the mesh's "tp" dimension, then FSDP2 shards
the result over the data-parallel dimensions: every parameter a DTensor on the (dp_shard, tp) mesh. A
model transformers already split (`from_pretrained(..., tp_plan="auto", device_mesh=mesh)` with our
mesh) is taken as it is.

Checkpoints stay gather-free: a colwise weight's rows and a rowwise weight's columns are this rank's
block of the file tensor (checkpoint/tensor_export.py `block_range`).

PEFT LoRA: the plan names the layers LoRA wrapped (`q_proj`), whose weights now live in
`q_proj.base_layer`. The base layer takes the planned style, and the adapter follows it so that
`base(x) + B(A(x))` adds like with like: under a colwise base (output features split) `lora_B` is
colwise too (`lora_A` stays whole: its input is the replicated x); under a rowwise base (input
features split, output all-reduced) `lora_A` is rowwise (its partial products are all-reduced like the
base's) and `lora_B` stays whole. The whole ones compute the same values and gradients on every TP
rank, as the norms do. transformers' own ColwiseParallel/RowwiseParallel do the work
(`apply_tensor_parallelism` with the plan's names moved onto those submodules).

Not done, refused by name: LoRA on a layer whose style is not colwise/rowwise (e.g. the embedding),
`lora_dropout` > 0 (each TP rank would drop different features of the same replicated input), DoRA,
PEFT's `modules_to_save` / `trainable_token_indices` (a trainable whole copy next to a split module),
merged-adapter export of a TP model (the rowwise layers' columns; save the adapter instead), 4-bit and
FP8 layers, regional compilation, models on the meta device (load the weights, or let transformers
load them split, first).

On paper (the memory estimate and the layout planner cost a TP layout from it without a process group,
planner/memory.py): TP splits a parameter along one dimension over the `tp` ranks (transformers' styles, read
from the plan `resolved_plan` gives, the one `shard_model` applies); FSDP2 then shards the rank's TP block by
dim-0 rows over the data-parallel ranks (`_chunk_with_empty` of the local tensor). Both splits are
`torch.chunk`-like (ceil, trailing ranks hold fewer): TP rank 0 holds the largest block, which is what
`tp_local_shapes` reports. Which dimension each style splits mirrors transformers' `shard_param` methods
(distributed/tensor_parallel.py); tests/test_memory.py checks the estimate byte for byte against real TP x FSDP
ranks, so it fails when transformers changes a placement. A style that splits parameters in a way not listed
here is refused by name, never guessed. Activations: a rank computes with its block of the heads and MLP
features. The trace runs a meta copy whose parameters have their TP-local shapes wherever the style keeps the
activations split (colwise output, rowwise input: attention heads and MLP features); where a style gathers or
reduces its output (embedding, `colwise_gather_output` lm_head), the tensors it saves are full, so those layers
are traced whole.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from . import parallel_plans
from .model_parts import ModelParts
from ..quantization import quantized
from ..config import TP_DIM


def is_tensor_parallel(model: nn.Module) -> bool:
    """Some parameter is a DTensor on a mesh with a "tp" dimension (TP applied, by us or transformers)."""
    return any(isinstance(p, DTensor) and TP_DIM in (p.device_mesh.mesh_dim_names or ())
               for p in model.parameters())


def refuse_unsupported(parts: ModelParts, config, on_meta: bool) -> None:
    """What TP does not cover yet, refused by name before anything changes."""
    model = parts.model
    reason = _unsupported_lora(model) if parts.has_peft else None
    if reason:
        pass  # named below
    elif quantized.has_quantized_layers(model):
        reason = "4-bit (bitsandbytes) layers"
    elif config.not_done_with("tp_size"):
        reason = config.not_done_with("tp_size")[0]
    elif on_meta:
        reason = ("a model on the meta device to initialise (hf_fsdp2.from_pretrained loads one onto its split; or "
                  "load it split with transformers' from_pretrained(..., tp_plan='auto', device_mesh=mesh))")
    if reason:
        raise NotImplementedError(f"`tp_size`={config.tp_size} with {reason} is not done in hf_fsdp2; use tp_size=1.")


def _lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """PEFT's LoRA layers by module name (duck-typed: a `base_layer` and `lora_A`/`lora_B` dicts)."""
    return {name: m for name, m in model.named_modules()
            if hasattr(m, "base_layer") and isinstance(getattr(m, "lora_A", None), nn.ModuleDict)}


def _unsupported_lora(model: nn.Module) -> str | None:
    for name, module in model.named_modules():
        if type(module).__name__ in ("ModulesToSaveWrapper", "TrainableTokensWrapper"):
            # PEFT's trainable copy of a whole module (`modules_to_save`, `trainable_token_indices`): the TP plan
            # splits the original, the copy stays whole, and their matmul mixes a plain tensor with a DTensor.
            return (f"PEFT's `modules_to_save` / `trainable_token_indices` (on {name}); train those modules "
                    "without TP, or leave them out of the PEFT config")
    for name, layer in _lora_layers(model).items():
        for adapter, dropout in getattr(layer, "lora_dropout", {}).items():
            if isinstance(dropout, nn.Dropout) and dropout.p > 0:
                return (f"`lora_dropout`={dropout.p} (adapter '{adapter}' on {name}: each TP rank would drop "
                        "different features of the same replicated input; set lora_dropout=0)")
        if any(getattr(layer, "use_dora", {}).values()):
            return f"DoRA (on {name})"
        if any(getattr(layer, "lora_bias", {}).values()):
            # lora_B's bias would need its base layer's split (colwise: the rows; rowwise: added once, after the
            # partial sums are reduced): "aten.addmm.default got mixed torch.Tensor and DTensor" otherwise.
            return f"`lora_bias` (on {name}; set lora_bias=False)"
    return None


# Where the adapter's factors go under each style of the base layer (see the module docstring).
_ADAPTER_STYLE = {"colwise": ("lora_B", "colwise"), "rowwise": ("lora_A", "rowwise")}


def plan_with_lora(model: nn.Module, tp_plan: dict[str, str]) -> dict[str, str]:
    """`tp_plan` (module and parameter names of the model as transformers built it) for the same model
    with PEFT's LoRA layers inside: each planned layer's style on its `base_layer`, and its adapters'
    factor that must follow the base's split (see the module docstring)."""
    lora = _lora_layers(model)
    out = {}
    for name, style in tp_plan.items():
        owner = name.rpartition(".")[0]
        if name in lora:
            if style not in _ADAPTER_STYLE:
                raise NotImplementedError(f"LoRA on `{name}`, which the model's TP plan splits as '{style}': only "
                                          "colwise and rowwise layers take adapters under tensor parallelism in "
                                          "hf_fsdp2; leave it out of `target_modules` or use tp_size=1.")
            out[f"{name}.base_layer"] = style
            # The plan was resolved against the wrapped model, whose parameter names lack `base_layer`:
            # the base layer's own weight and bias take the style here.
            for param_name, _ in lora[name].base_layer.named_parameters(recurse=False):
                out[f"{name}.base_layer.{param_name}"] = style
            factor, factor_style = _ADAPTER_STYLE[style]
            for adapter in getattr(lora[name], factor):
                out[f"{name}.{factor}.{adapter}"] = factor_style
                out[f"{name}.{factor}.{adapter}.weight"] = factor_style
        elif owner in lora:
            continue  # a wrapped layer's own weight/bias (where the plan names them): set with the layer above
        else:
            out[name] = style
    return out


def apply_tensor_parallel(parts: ModelParts, tp_mesh: DeviceMesh) -> None:
    """The model's own TP plan on `tp_mesh`, resolved and applied by transformers (every rank must hold
    the same full weights: each keeps its own part of them, with no communication)."""
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    apply_tensor_parallelism(parts.base, tp_mesh, resolved_plan(parts.base, tp_mesh.size()))


def resolved_plan(base: nn.Module, tp_size: int) -> dict[str, str]:
    """The TP plan of `base` (the transformers model, under PEFT if wrapped) for `tp_size` ranks, one entry per
    module or parameter (as `from_pretrained(distributed_config=...)` resolves it: `_resolve_parallel_plans`, then
    `plan_with_lora`). Pure: the memory estimate reads it too (`tp_local_shapes`)."""
    tp_plan = parallel_plans.resolve(base, f"`tp_size`={tp_size}: {type(base).__name__} is not a transformers model "
                                           "with a tensor-parallel plan.", tp_size=tp_size)[0]
    return plan_with_lora(base, tp_plan)


# On paper: what TP does to one rank's tensors (the planner's estimate and trace).

def _split_dim(style, param_name: str, ndim: int) -> int | None:
    """The dimension `style` splits the parameter along (None: replicated), as its `shard_param` does."""
    from transformers.distributed.tensor_parallel import (
        ColwiseParallel,
        EmbeddingParallel,
        PackedColwiseParallel,
        PackedRowwiseParallel,
        RowwiseParallel,
        TensorParallelLayer,
    )

    if isinstance(style, (ColwiseParallel, PackedColwiseParallel)):
        return ndim - 2 if ndim > 1 else 0  # Shard(ndim - 2): the output features (a bias: its only dim)
    if isinstance(style, PackedRowwiseParallel):
        return None if ndim == 1 else ndim - 1
    if isinstance(style, RowwiseParallel):
        return None if param_name == "bias" else ndim - 1  # Shard(-1): the input features; bias replicated
    if isinstance(style, EmbeddingParallel):
        return style.shard_dim % ndim
    if type(style).shard_param is TensorParallelLayer.shard_param:
        return None  # a style that only hooks the forward
    raise NotImplementedError(f"the memory estimate does not know how transformers' TP style "
                              f"{type(style).__name__} splits parameters; estimate with tp_size=1.")


def _keeps_activations_split(style) -> bool:
    """Whether the style's layer computes on a block of the features (colwise output left sharded,
    rowwise input sharded), so the trace narrows it; else it sees and saves whole activations."""
    from torch.distributed.tensor import Shard
    from transformers.distributed.tensor_parallel import (
        ColwiseParallel,
        PackedColwiseParallel,
        PackedRowwiseParallel,
        RowwiseParallel,
    )

    if isinstance(style, (PackedColwiseParallel, PackedRowwiseParallel)):
        return True
    if isinstance(style, ColwiseParallel):
        return isinstance(style.output_layouts, Shard)
    if isinstance(style, RowwiseParallel):
        return isinstance(style.input_layouts, Shard)
    return False


def _chunk(size: int, parts: int) -> int:
    """Rank 0's part of `size` split `torch.chunk`-like into `parts` (the largest)."""
    return -(-size // parts)


def tp_local_shapes(base: nn.Module, tp_size: int) -> dict[int, tuple[torch.Size, bool]]:
    """id(parameter) -> (the shape of TP rank 0's block, whether the trace narrows it) for every
    parameter the TP plan of `base` (the transformers model, under PEFT if wrapped) splits over `tp_size`
    ranks; parameters it leaves whole are absent."""
    if tp_size == 1:
        return {}
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    plan = resolved_plan(base, tp_size)
    params = dict(base.named_parameters())
    module_styles = {name: style for name, style in plan.items() if name not in params}
    out: dict[int, tuple[torch.Size, bool]] = {}
    for name, style_name in plan.items():
        param = params.get(name)
        if param is None:
            continue
        style = ALL_PARALLEL_STYLES[style_name]
        module_name, _, param_name = name.rpartition(".")
        dim = _split_dim(style, param_name, param.ndim)
        if dim is None:
            continue
        shape = list(param.shape)
        shape[dim] = _chunk(shape[dim], tp_size)
        owner = ALL_PARALLEL_STYLES[module_styles[module_name]] if module_name in module_styles else style
        out[id(param)] = (torch.Size(shape), _keeps_activations_split(owner))
    return out


def narrow_for_trace(model: nn.Module, shapes: dict[int, tuple[torch.Size, bool]]) -> None:
    """Give a meta model's parameters the TP-local shapes the trace computes with (in place)."""
    for p in model.parameters():
        entry = shapes.get(id(p))
        if entry is not None and entry[1]:
            p.data = torch.empty(entry[0], dtype=p.dtype, device="meta")
