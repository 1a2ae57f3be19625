"""On-disk names and layout of a model whose tensors transformers keeps differently in memory.

Transformers 5 converts some checkpoints when loading (`core_model_loading.convert_and_load_state_dict_in_model`)
and reverts the conversion when saving (`revert_weight_conversion`), driven by
`conversion_mapping.get_model_conversion_mapping`: MoE experts stored one tensor per expert on disk
(`...block_sparse_moe.experts.3.w1.weight`) are fused in memory (`...mlp.experts.gate_up_proj`,
experts stacked on dim 0, gate and up concatenated on dim 1), modules are renamed, and so on.

We run transformers' own revert, not a table of ours, but on stand-ins instead of the weights, so
nothing is gathered:
- tensors only renamed are passed as meta tensors and come back under their disk name;
- tensors a converter rearranges are passed as small "probes" of int64 element ids (only the dims
  the converter's ops act on are kept; the others are size 1), so each disk tensor comes back as the
  ids of the memory elements it is made of. We accept two shapes of that answer, which cover
  transformers' MoE conversions: disk = memory[e, lo:hi] (one expert's slice: written whole by the
  rank owning row e, since FSDP2 shards dim 0 and so whole experts), or disk = memory[lo:hi] (rows:
  each rank writes the rows it owns). Any other rearrangement is refused with an error naming it.
Loading a stock checkpoint reads the same views in reverse, each rank only its own rows/experts.

Transformers 4 has no conversion mapping (its MoE experts are separate modules): everything maps 1:1.
"""

from __future__ import annotations

import bisect
import contextlib
import math
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn as nn

from .errors import CheckpointError
from ..runtime import upstream

_FULLY_SHARD = "torch.distributed.fsdp._fully_shard._fully_shard.fully_shard"  # its FSDP<Name> classes
_REPLICATE = "torch.distributed._composable.replicate.replicate"  # its DDP<Name> classes

_PROBE_LIMIT = 1 << 26  # elements of one probe (512 MiB of int64): beyond, a conversion is not gather-free


@dataclass(frozen=True)
class DiskView:
    """Disk tensor `name` is `source[index, lo:hi]` (index not None) or `source[lo:hi]` of memory tensor
    `source`; `shape` is the disk tensor's global shape."""

    name: str
    source: str
    index: int | None
    lo: int
    hi: int
    shape: tuple[int, ...]

    def rows_from(self, start: int, stop: int) -> tuple[int, int, slice | tuple]:
        """For a rank holding memory rows [start, stop): (first, stop) disk rows it holds, and the index
        into its local memory block that yields them."""
        if self.index is not None:
            if start <= self.index < stop:
                return 0, self.hi - self.lo, (self.index - start, slice(self.lo, self.hi))
            return 0, 0, ()
        a, b = max(self.lo, start), min(self.hi, stop)
        if b <= a:
            return 0, 0, ()
        return a - self.lo, b - self.lo, slice(a - start, b - start)


def _wrapper_of(cls: type) -> tuple[type, str] | None:
    """(the model class, the seam that made it) under a generated wrapper class: `fully_shard`'s
    `FSDP<Name>` (bases FSDPModule, the original; torch/distributed/fsdp/_fully_shard/_fully_shard.py) or
    composable `replicate`'s `DDP<Name>` (bases DDP, the original; torch/distributed/_composable/replicate.py)."""
    from torch.distributed._composable.replicate import DDP
    from torch.distributed.fsdp import FSDPModule

    for prefix, marker, seam in (("FSDP", FSDPModule, _FULLY_SHARD), ("DDP", DDP, _REPLICATE)):
        if cls.__name__.startswith(prefix) and len(cls.__bases__) == 2 and cls.__bases__[0] is marker:
            return cls.__bases__[1], seam
    return None


def original_class(cls: type) -> type | None:
    """The model class under `fully_shard`'s or `replicate`'s wrapper class; None: not a wrapper class."""
    wrapped = _wrapper_of(cls)
    return wrapped[0] if wrapped else None


@contextlib.contextmanager
def _original_classes(model: nn.Module) -> Iterator[None]:
    """Transformers looks conversions up by class name, so for that lookup show it the original classes
    under `fully_shard`'s and `replicate`'s wrapper classes."""
    swapped = []
    for module in model.modules():
        wrapped = _wrapper_of(type(module))
        if wrapped is not None:
            swapped.append((module, type(module), wrapped[1]))
            upstream.set_class(module, wrapped[0], wrapped[1])
    try:
        yield
    finally:
        for module, cls, seam in swapped:
            upstream.set_class(module, cls, seam)


def _conversions(model: nn.Module) -> list | None:
    """Transformers' reversed converters for `model` as `revert_weight_conversion` builds them, or None
    (no mapping, or not a PreTrainedModel)."""
    from transformers import PreTrainedModel
    from transformers.conversion_mapping import get_model_conversion_mapping

    if not isinstance(model, PreTrainedModel):
        return None
    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:  # as revert_weight_conversion does for a model not made by from_pretrained
        from transformers.core_model_loading import PrefixChange

        conversions = [c for c in get_model_conversion_mapping(model, add_legacy=False)
                       if not isinstance(c, PrefixChange)]
    return conversions or None


def _matching_converter(name: str, converters: list, renamings: list):
    """The reversed converter that consumes memory tensor `name`, if any. Transformers 5.0 renames a key
    before matching converters, later 5.x match first (`rename_source_key`, reverse): try both."""
    renamed = name
    for renaming in renamings:
        renamed, _ = renaming.rename_source_key(renamed)
    for key in dict.fromkeys((name, renamed)):
        for converter in converters:
            _, pattern = converter.rename_source_key(key)
            if pattern is not None:
                return converter
    return None


def _kept_dims(converter, ndim: int) -> int:
    """How many leading dims a probe must keep so the converter's ops act on it as on the real tensor."""
    dims = []
    for op in getattr(converter, "operations", []):
        found = [getattr(op, a) for a in ("dim", "dim0", "dim1") if isinstance(getattr(op, a, None), int)]
        if not found:
            return ndim  # an op we cannot see into: keep everything
        dims += found
    return min(ndim, 1 + max((d % ndim for d in dims), default=0)) if ndim else 0


def disk_views(model: nn.Module, tensors: dict[str, torch.Tensor]) -> list[DiskView] | None:
    """The disk tensors `save_pretrained` would write for `tensors` (memory name -> global tensor) of
    `model`, in transformers' order; None when no conversion applies (disk names = memory names)."""
    with _original_classes(model):
        return _disk_views(model, tensors)


def _disk_views(model: nn.Module, tensors: dict[str, torch.Tensor]) -> list[DiskView] | None:
    conversions = _conversions(model)
    if conversions is None:
        return None
    from transformers.core_model_loading import WeightConverter, WeightRenaming, revert_weight_conversion

    reversed_transforms = [c.reverse_transform() for c in conversions[::-1]]
    converters = [c for c in reversed_transforms if isinstance(c, WeightConverter)]
    renamings = [c for c in reversed_transforms if isinstance(c, WeightRenaming)]
    stand_ins: dict[str, torch.Tensor] = {}
    probes: dict[str, tuple[torch.Tensor, int]] = {}  # name -> (probe, first id)
    renamed: dict[int, str] = {}  # id(meta stand-in) -> memory name
    next_id = 0
    for name, tensor in tensors.items():
        shape = tuple(tensor.shape)
        converter = _matching_converter(name, converters, renamings)
        if converter is None:
            stand_ins[name] = torch.empty(shape, dtype=tensor.dtype, device="meta")
            renamed[id(stand_ins[name])] = name
            continue
        kept = _kept_dims(converter, len(shape))
        # Dims the ops do not act on shrink to 2 (not 1: transformers 5.0's SplitModulelist squeezes every
        # size-1 dim, so a size-1 stand-in would come back with another rank than the real tensor).
        probe_shape = shape[:kept] + tuple(min(d, 2) for d in shape[kept:])
        if math.prod(probe_shape) > _PROBE_LIMIT:
            raise CheckpointError(f"{name}: transformers' conversion {converter!r} rearranges this tensor in a way "
                                  "hf_fsdp2 cannot write by rows without gathering it.")
        probe = torch.arange(next_id, next_id + math.prod(probe_shape), dtype=torch.int64).reshape(probe_shape)
        probes[name] = (probe, next_id)
        stand_ins[name] = probe
        next_id += probe.numel()
    reverted = revert_weight_conversion(model, stand_ins)
    starts = sorted((first, name) for name, (_, first) in probes.items())
    views = []
    for disk_name, value in reverted.items():
        if id(value) in renamed:
            source = renamed[id(value)]
            views.append(DiskView(disk_name, source, None, 0, value.shape[0] if value.dim() else 1, tuple(value.shape)))
            continue
        views.append(_probe_view(disk_name, value, probes, starts, tensors))
    return views


def _probe_view(disk_name: str, value: torch.Tensor, probes, starts, tensors) -> DiskView:
    """Which slice of which memory tensor a converted disk tensor is, from the ids it came back with."""
    if value.dtype != torch.int64 or value.numel() == 0 or value.dim() == 0:
        raise CheckpointError(f"{disk_name}: transformers' conversion produced a tensor hf_fsdp2 cannot place.")
    first = int(value.reshape(-1)[0])
    source = starts[bisect.bisect_right(starts, (first, "\uffff")) - 1][1]  # the probe whose ids hold `first`
    probe, base = probes[source]
    position = torch.unravel_index(torch.tensor(first - base), probe.shape)
    full = tuple(tensors[source].shape)
    rows = value.shape[0]
    if len(full) >= 2:  # one expert's slice: memory[e, lo:lo + rows]
        e, lo = int(position[0]), int(position[1])
        collapsed = probe.shape[1] != full[1]  # then the disk tensor must take all of dim 1
        if lo + rows <= probe.shape[1] and probe[e, lo:lo + rows].shape == value.shape \
                and torch.equal(probe[e, lo:lo + rows], value) and not (collapsed and (lo, rows) != (0, probe.shape[1])):
            hi = full[1] if collapsed else lo + rows
            return DiskView(disk_name, source, e, lo, hi, (hi - lo,) + full[2:])
    lo = int(position[0])  # rows: memory[lo:lo + rows]
    if lo + rows <= probe.shape[0] and probe[lo:lo + rows].shape == value.shape and torch.equal(probe[lo:lo + rows], value):
        return DiskView(disk_name, source, None, lo, lo + rows, (rows,) + full[1:])
    raise CheckpointError(f"{disk_name}: transformers' conversion of {source} rearranges it beyond whole experts or "
                          "row blocks; hf_fsdp2 cannot write or read it without gathering.")
