"""A sharded model's weights as whole tensors, one at a time, under the names `save_pretrained`
writes: what an inference engine that loads Hugging Face checkpoints needs (TRL's vLLM weight sync).

The tensors are the export plan's (checkpoint/export_plan.py): a PeftModel's adapters
merged into the base weights, a 4-bit base dequantized, transformers' conversion mapping reverted
(hub names, e.g. one tensor per MoE expert). Each rank contributes the rows it would write to the
file; one collective per tensor makes it whole on every rank. Peak memory: one whole tensor.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.nn as nn

from .export_plan import export_items
from ..sharding.model_parts import model_parts
from ..runtime import collectives
from ..sharding import record_of


def full_weights(model: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole tensor) for every tensor of the model as saved (merged, for a PeftModel), on the
    device the mesh's collectives use. Collective: iterate to the end on every rank, in step."""
    record = record_of(model)
    if record is None or record.mesh is None:
        raise ValueError("full_weights: this model was not sharded by hf_fsdp2 (shard_model / register()).")
    device = collectives.mesh_device(record.mesh)
    parts = model_parts(model)
    items, _ = export_items(parts, dtype, merge_adapters=parts.has_peft)
    for item in items:
        spec = item.spec
        whole = torch.zeros(spec.shape, dtype=spec.dtype, device=device)
        start, stop = item.rows()
        cols = item.cols()
        if stop > start:
            rows = whole.view(1, *spec.shape) if not spec.shape else whole
            block = item.block().to(device=device, dtype=spec.dtype)
            if cols is None:
                rows[start:stop] = block.view(stop - start, *rows.shape[1:])
            else:  # a tensor-parallel rowwise split
                rows[start:stop, cols[0]:cols[1]] = block
        # Every row has exactly one writer (replicas and non-owners contribute zeros): a sum over the
        # mesh makes it whole. Twice an all-gather's traffic, but any row split (uneven shards,
        # per-expert views). On the mesh's groups, which carry `device` tensors.
        collectives.sum_over_mesh(whole, record.mesh)
        yield item.name, whole
