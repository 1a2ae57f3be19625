"""What tensor parallelism (TP) does to one rank's tensors, on paper: the memory estimate and the
layout planner cost a TP layout from it without a process group.

TP splits a parameter along one dimension over the `tp` ranks (transformers' styles, read from the
plan `tensor_parallel.resolved_plan` gives, the one `shard_model` applies); FSDP2 then shards the
rank's TP block by dim-0 rows over the data-parallel ranks (`_chunk_with_empty` of the local tensor).
Both splits are `torch.chunk`-like (ceil, trailing ranks hold fewer): TP rank 0 holds the largest
block, which is what this module reports.

Which dimension each style splits mirrors transformers' `shard_param` methods (distributed/
tensor_parallel.py); tests/test_memory.py checks the estimate byte for byte against real TP x FSDP
ranks, so it fails when transformers changes a placement. A style that splits parameters in a way
not listed here is refused by name, never guessed.

Activations: a rank computes with its block of the heads and MLP features. The trace runs a meta
copy whose parameters have their TP-local shapes wherever the style keeps the activations split
(colwise output, rowwise input: attention heads and MLP features); where a style gathers or reduces
its output (embedding, `colwise_gather_output` lm_head), the tensors it saves are full, so those
layers are traced whole.

Context parallelism (CP) needs nothing here: each rank holds seq_len / cp tokens of every sequence
(the trace runs at that length) and FSDP2 shards over dp_shard x cp (the shard size already counts
the cp ranks).
"""

from __future__ import annotations

import torch
import torch.nn as nn


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


def chunk(size: int, parts: int) -> int:
    """Rank 0's part of `size` split `torch.chunk`-like into `parts` (the largest)."""
    return -(-size // parts)


def tp_local_shapes(base: nn.Module, tp_size: int) -> dict[int, tuple[torch.Size, bool]]:
    """id(parameter) -> (the shape of TP rank 0's block, whether the trace narrows it) for every
    parameter the TP plan of `base` (the transformers model, under PEFT if wrapped) splits over `tp_size`
    ranks; parameters it leaves whole are absent."""
    if tp_size == 1:
        return {}
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    from ..sharding.tensor_parallel import resolved_plan

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
        shape[dim] = chunk(shape[dim], tp_size)
        owner = ALL_PARALLEL_STYLES[module_styles[module_name]] if module_name in module_styles else style
        out[id(param)] = (torch.Size(shape), _keeps_activations_split(owner))
    return out


def narrow_for_trace(model: nn.Module, shapes: dict[int, tuple[torch.Size, bool]]) -> None:
    """Give a meta model's parameters the TP-local shapes the trace computes with (in place)."""
    for p in model.parameters():
        entry = shapes.get(id(p))
        if entry is not None and entry[1]:
            p.data = torch.empty(entry[0], dtype=p.dtype, device="meta")


__all__ = ["chunk", "narrow_for_trace", "tp_local_shapes"]
