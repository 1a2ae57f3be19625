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
from torch.distributed.device_mesh import DeviceMesh

from .export_plan import export_items
from ..runtime import collectives
from ..sharding.model_parts import ModelParts


def full_weights(parts: ModelParts, mesh: DeviceMesh | None, dtype: torch.dtype | None = None
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole tensor) for every tensor of the model of `parts` as saved (merged, for a PeftModel), on the
    device the collectives of `mesh` (its record's: the one it was sharded on) use. Collective: iterate to the
    end on every rank, in step."""
    if mesh is None:
        raise ValueError("full_weights: this model was not sharded by hf_fsdp2 (shard_model / register()).")
    device = collectives.mesh_device(mesh)
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
        collectives.sum_over_mesh(whole, mesh)
        yield item.name, whole
