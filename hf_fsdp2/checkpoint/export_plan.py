"""The export plan: which tensors `save_pretrained` (and the training state, and `full_weights`)
writes, decided once per tensor and read straight down:

1. which tensors: a PeftModel's adapter keys, or the base model's tensors with the adapter merged,
   or the whole model (tensor_export.py);
2. where each tensor's rows come from: the rank's local shard, or its packed 4-bit rows dequantized
   (quantization/quantized.py), plus a merged adapter's delta of those rows (lora_merge.py);
3. its name and layout on disk: transformers' conversion mapping reverted (key_conversion.py).

The modules named above only answer questions (a delta, a dequantized block, a view); none of them
builds an `ExportTensor` or calls back into another.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator

import torch
import torch.nn as nn

from ..quantization import quantized
from ..runtime.distributed import local_tensor
from .key_conversion import disk_views
from .lora_merge import RowsDelta, adapter_deltas, base_model_name
from ..sharding.model_parts import ModelParts
from .tensor_export import ExportTensor, adapter_tensors, model_tensors, row_range


def export_items(parts: ModelParts, dtype: torch.dtype | None,
                 merge_adapters: bool) -> tuple[list[ExportTensor], bool]:
    """(items, is_adapter) for the model of `parts` as `save_pretrained` writes it. Collective when merging (the
    LoRA factors are all-gathered, in module order): call on every rank."""
    model = parts.model
    if parts.has_peft:
        if merge_adapters:
            return _as_on_disk(parts.base, _merged_items(model, dtype)), False
        tensors = adapter_tensors(model)
        if not tensors:
            raise ValueError("the PeftModel's adapter has no tensors to save; check its `target_modules`.")
        return [_item(n, t, dtype) for n, t in tensors.items()], True
    if merge_adapters:
        raise ValueError("`merge_adapters=True` needs a PeftModel; this model has no adapters.")
    packed = [n for n, m in model.named_modules() if quantized.is_prepared(m)]
    if packed:
        raise NotImplementedError(
            f"saving the packed 4-bit base weights ({packed[0]}, ...) is not supported: train a PEFT adapter "
            "on the 4-bit model and save the adapter, or save it merged (merge_adapters=True) as a plain model.")
    return _as_on_disk(model, [_item(n, t, dtype) for n, t in model_tensors(model).items()]), False


def _item(name: str, tensor: torch.Tensor, dtype: torch.dtype | None) -> ExportTensor:
    return ExportTensor(name, tensor, dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype)


def _merged_items(model: nn.Module, dtype: torch.dtype | None) -> list[ExportTensor]:
    """The base model's tensors (base-model names) with the active adapter merged in; a 4-bit base
    weight is written dequantized (a plain model, as PEFT's merge gives before requantizing) and its
    absmax not at all."""
    deltas = adapter_deltas(model, getattr(model, "active_adapter", "default"))
    weights = quantized.weights(model)
    side = {id(p) for weight in weights.values() for p in weight.side}  # scales: not in a plain model
    cache: dict[str, object] = {}  # one merged block: a fused-experts tensor feeds 2E file tensors in a row
    items = []
    for name, tensor in model_tensors(model).items():
        hf_name = base_model_name(name)
        if hf_name is None or id(tensor) in side:
            continue
        delta = deltas.get(id(tensor))
        if id(tensor) in weights:
            weight = weights[id(tensor)]
            items.append(ExportTensor(hf_name, tensor, dtype if dtype is not None else weight.dtype,
                                      _dequantized_rows(weight, delta), shape=(weight.out_features, weight.in_features)))
            continue
        item = _item(hf_name, tensor, dtype)
        items.append(item if delta is None else dataclasses.replace(
            item, local_rows=_merged_rows(tensor, delta, cache), local_pieces=_merged_pieces(tensor, delta)))
    return items


def _dequantized_rows(weight: quantized.QuantizedWeight, delta: RowsDelta | None) -> Callable[[], torch.Tensor]:
    """This rank's rows of a sharded quantized weight, dequantized from its own packed rows (whole
    quantization blocks, see quantization/quantized.py), plus the adapter's delta of those rows."""
    def compute() -> torch.Tensor:
        start, stop = row_range(weight.packed)
        w = weight.dequantized_rows(start)
        return w if delta is None else _plus_delta(w, delta, start, stop)

    return compute


def _merged_rows(weight: torch.Tensor, delta: RowsDelta, cache: dict) -> Callable[[], torch.Tensor]:
    def compute() -> torch.Tensor:
        if cache.get("weight") is not weight:
            start, stop = row_range(weight)
            cache["weight"], cache["block"] = weight, _plus_delta(local_tensor(weight), delta, start, stop)
        return cache["block"]

    return compute


MERGE_CHUNK_BYTES = 8 << 20  # fp32 delta per piece of a merge: small buffers the allocator reuses


def _merged_pieces(weight: torch.Tensor, delta: RowsDelta) -> Callable[[], Iterator[tuple[int, torch.Tensor]]]:
    """This rank's merged rows piece by piece, for the writer to overlap with (weights_io.py): each piece
    computed into one of two buffers used in turn, through one fp32 scratch, so a merged save allocates no
    block-sized tensor (fresh block-sized buffers are page-faulted in on every save: at 1B parameters most of
    a merged save's time; a fresh fp32 copy per piece cost 1.5 ns per element against 1.2 reused, one core)."""
    def pieces() -> Iterator[tuple[int, torch.Tensor]]:
        start, _ = row_range(weight)
        rows = local_tensor(weight)
        buffers: list[torch.Tensor] = []
        scratch = _Scratch()
        for i, (lo, hi) in enumerate(_row_chunks(rows)):
            if len(buffers) < 2:
                buffers.append(torch.empty_like(rows[lo:hi]))
            out = buffers[i % 2][:hi - lo]
            yield lo, _add_delta_into(out, rows[lo:hi], delta, start + lo, start + hi, scratch)
    return pieces


class _Scratch:
    """One fp32 buffer reused for every piece of a merge (grown to the largest piece)."""

    def __init__(self):
        self._buffer: torch.Tensor | None = None

    def fp32_copy(self, rows: torch.Tensor) -> torch.Tensor:
        if self._buffer is None or self._buffer.numel() < rows.numel() or self._buffer.device != rows.device:
            self._buffer = torch.empty(rows.numel(), dtype=torch.float32, device=rows.device)
        return self._buffer[:rows.numel()].view(rows.shape).copy_(rows)


def _row_chunks(rows: torch.Tensor) -> list[tuple[int, int]]:
    n = rows.shape[0]
    step = max(1, MERGE_CHUNK_BYTES // max(1, rows[:1].numel() * 4))
    return [(lo, min(n, lo + step)) for lo in range(0, n, step)]


def _add_delta_into(out: torch.Tensor, rows: torch.Tensor, delta: RowsDelta, start: int, stop: int,
                    scratch: _Scratch) -> torch.Tensor:
    """out = rows + delta(start, stop), added in fp32, cast to out's dtype: into an fp32 copy of the rows (in
    `scratch`, never the model's own fp32 rows) in one BLAS call where the delta can
    (`LinearRowsDelta.add_into`), else in place on the fresh fp32 delta."""
    add_into = getattr(delta, "add_into", None)
    if add_into is not None:
        return out.copy_(add_into(scratch.fp32_copy(rows), start, stop))
    return out.copy_(delta(start, stop).to(rows.device).add_(rows))


def _plus_delta(rows: torch.Tensor, delta: RowsDelta, start: int, stop: int) -> torch.Tensor:
    """Base rows [start, stop) + the adapter's delta of those rows, added in fp32, in the rows' dtype: by
    chunks of rows into one output (no block-sized fp32 tensor)."""
    out = torch.empty_like(rows)
    scratch = _Scratch()
    for lo, hi in _row_chunks(rows):
        _add_delta_into(out[lo:hi], rows[lo:hi], delta, start + lo, start + hi, scratch)
    return out


def _as_on_disk(model: nn.Module, items: list[ExportTensor]) -> list[ExportTensor]:
    """`items` under the names and layout stock `save_pretrained` writes (transformers' conversion
    mapping reverted, e.g. fused MoE experts split into one tensor per expert), in its order."""
    views = disk_views(model, {item.name: item.tensor for item in items})
    if views is None:
        return items
    by_name = {item.name: item for item in items}
    return [dataclasses.replace(by_name[v.source], name=v.name, view=v) for v in views]
