"""Which tensors a sharded model exports, under which Hugging Face names, and how each rank reaches
its own rows of them.

A model tensor is a `DTensor` sharded on dim 0 (FSDP2) and possibly replicated across an HSDP
dimension, or a plain tensor that every rank holds whole (buffers). Each rank owns a contiguous
block of rows; under replication only the replica at coordinate 0 writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard  # FSDP2 over TP's colwise rows

from .key_conversion import DiskView
from .safetensors_io import TensorSpec
from ..runtime import collectives
from ..runtime.distributed import local_tensor, reshard
from ..sharding import canonical_name


@dataclass
class ExportTensor:
    """One tensor of a checkpoint: its file key, the live tensor, and the dtype on disk."""

    name: str
    tensor: torch.Tensor  # DTensor (sharded) or plain (whole on every rank)
    dtype: torch.dtype
    # Computes this rank's rows when they are not simply the local shard (merged LoRA weights).
    local_rows: Callable[[], torch.Tensor] | None = None
    # The file tensor is this slice of `tensor` (transformers' conversion mapping, e.g. one MoE expert).
    view: DiskView | None = None
    # The file tensor's shape when `local_rows` computes rows of another shape than `tensor`'s (a
    # 4-bit weight's packed rows written dequantized); the rows are `tensor`'s rows.
    shape: tuple[int, ...] | None = None
    # `local_rows` piece by piece: (first row, relative to this rank's, rows) pairs, each valid until the
    # next is asked for (a merged adapter computes them into reused buffers; see `pieces`).
    local_pieces: Callable[[], Iterator[tuple[int, torch.Tensor]]] | None = None

    @property
    def spec(self) -> TensorSpec:
        shape = self.view.shape if self.view else self.shape if self.shape is not None else tuple(self.tensor.shape)
        return TensorSpec(self.name, self.dtype, shape)

    def rows(self) -> tuple[int, int]:
        """The file tensor's rows [start, stop) this rank writes."""
        if not is_writer(self.tensor):
            return 0, 0
        if self.view is None and self.local_rows is None:  # plain parameters may be split by columns (TP)
            return block_range(self.tensor)[:2]
        start, stop = row_range(self.tensor)
        return (start, stop) if self.view is None else self.view.rows_from(start, stop)[:2]

    def cols(self) -> tuple[int, int] | None:
        """The columns of those rows this rank writes (a tensor-parallel rowwise split); None: all."""
        if self.local_rows is None and self.view is None and is_writer(self.tensor):
            return block_range(self.tensor)[2]
        return None

    def pieces(self) -> Iterator[tuple[int, torch.Tensor]]:
        """This rank's rows of the file tensor as (first row relative to `rows()[0]`, rows) pieces: computed
        piece by piece where they can be (a merged adapter), else `block()` whole. A piece may be overwritten
        once the next one is asked for: write it before."""
        if self.local_pieces is not None and self.view is None:
            yield from self.local_pieces()
        else:
            yield 0, self.block()

    def block(self) -> torch.Tensor:
        """This rank's rows of the file tensor (those `rows()` names; only `cols()` of them)."""
        data = self.local_rows() if self.local_rows is not None else local_tensor(self.tensor)
        if self.view is None:
            return data
        return data[self.view.rows_from(*row_range(self.tensor))[2]]


def block_range(tensor: torch.Tensor) -> tuple[int, int, tuple[int, int] | None]:
    """This rank's block of `tensor`: global rows [start, stop) and, when it holds only some columns
    of a 2-D tensor (a rowwise tensor-parallel weight), those columns [first, stop); None: whole rows.

    Rows come from FSDP2's dim-0 sharding (a `_StridedShard` under TP too: still one contiguous run
    of rows per rank) and a colwise TP split; columns from a rowwise TP split (Shard(1))."""
    if not isinstance(tensor, DTensor):
        return 0, tensor.shape[0] if tensor.dim() else 1, None
    for placement in tensor.placements:
        if not (isinstance(placement, Replicate) or (isinstance(placement, (Shard, _StridedShard)) and (
                placement.dim == 0 or (placement.dim in (1, -1) and tensor.dim() == 2)))):
            raise ValueError(f"hf_fsdp2 checkpoints need dim-0 sharding (FSDP2's default), or columns of a 2-D "
                             f"tensor-parallel weight; got placements {tensor.placements}. Remove a custom "
                             "`shard_placement_fn`.")
    if tensor.dim() == 0:
        return 0, 1, None
    local_shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    cols = None
    if tensor.dim() == 2 and local_shape[1] != tensor.shape[1]:
        cols = (offset[1], offset[1] + local_shape[1])
    return offset[0], offset[0] + local_shape[0], cols


def row_range(tensor: torch.Tensor) -> tuple[int, int]:
    """The global rows [start, stop) this rank holds of `tensor` (all rows for a plain tensor); for
    code that handles whole rows only."""
    start, stop, cols = block_range(tensor)
    if cols is not None:
        raise ValueError(f"a tensor split by columns (tensor parallelism, placements {tensor.placements}) where "
                         "hf_fsdp2 handles whole rows only (merged adapters, 4-bit, rank-0 loading)")
    return start, stop


def is_writer(tensor: torch.Tensor) -> bool:
    """Exactly one copy of every row is written: replicas other than coordinate 0 stay silent."""
    if not isinstance(tensor, DTensor):
        return collectives.rank() == 0
    coords = tensor.device_mesh.get_coordinate()
    if coords is None:
        return False
    return all(c == 0 for c, p in zip(coords, tensor.placements) if isinstance(p, Replicate))


def persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    out = []
    for module_name, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in module._non_persistent_buffers_set:
                out.append((f"{module_name}.{name}" if module_name else name, buf))
    return out


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Canonical name -> parameter or persistent buffer; a tied weight appears once, under its first name.
    The model is resharded first, whatever state its last forward left it in."""
    reshard(model)
    out = {canonical_name(n): p for n, p in model.named_parameters()}
    out.update({canonical_name(n): b for n, b in persistent_buffers(model)})
    return out


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """Alias name -> the name `model_tensors` uses, for weights shared by several modules."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        name = canonical_name(name)
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def adapter_tensors(model: nn.Module, adapter_name: str = "default") -> dict[str, torch.Tensor]:
    """PEFT's own file keys for the adapter (adapter name removed) -> the live sharded tensors.

    Delegates the key logic to `peft.get_peft_model_state_dict`, which only selects and renames
    entries of the state dict it is given, so passing DTensors keeps them sharded.
    """
    from peft import get_peft_model_state_dict

    reshard(model)
    # PEFT >= 0.21 selects the entries by the names of its tuner layers in `model.named_modules()`,
    # which keep activation checkpointing's wrapper prefix: give it those names, return ours.
    wrapped = dict(model.named_parameters())
    wrapped.update(persistent_buffers(model))
    selected = get_peft_model_state_dict(model, state_dict=wrapped, adapter_name=adapter_name)
    return {canonical_name(name): tensor for name, tensor in selected.items()}
