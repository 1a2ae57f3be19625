"""What the rest of hf_fsdp2 needs from a quantized base, in one small interface.

A quantized base keeps each quantized linear's weight as packed rows that FSDP2 shards by dim 0 like any
parameter, with per-row side data (scales) sharded beside it, so a rank's shard is whole rows and it can
quantize or dequantize its own rows alone. Sharding, the planner, loading and export reach a quantized
base only through this module:

- sharding (sharding/engine.py, tensor_parallel.py, compiled_collectives.py): `refuse_unsupported`,
  `prepare` (the row layout, before `fully_shard`), `has_quantized_layers` (a technique not done with a
  quantized base refuses it by name);
- estimating (planner/memory.py): `check_available`, `quantize_on_meta`, `prepare`, `weights` (per
  weight its logical shape and its matmul's transient bytes);
- loading (checkpoint/loading.py, pretrained.py, weights_io.py): `quantize_on_meta`, `prepare`,
  `unprepared_layers`, `source_dtype`, `QuantizedWeight.load_rows`;
- export (checkpoint/export_plan.py, lora_merge.py): `weights`, `is_prepared`,
  `QuantizedWeight.dequantized_rows`.

bitsandbytes 4-bit (quantization/bnb_4bit.py) is the first implementation; another (torchao int4, HQQ)
implements `Quantizer` and joins `QUANTIZERS`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import torch
import torch.nn as nn


@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """One prepared quantized weight as the rest of hf_fsdp2 sees it."""

    module: nn.Module
    packed: nn.Parameter  # the packed rows (sharded like any parameter; never saved as they are)
    side: tuple[nn.Parameter, ...]  # per-row side data sharded with them (scales): never saved
    out_features: int
    in_features: int
    dtype: torch.dtype  # the float dtype a checkpoint holds, a load quantizes from and a save writes
    kind: str  # e.g. "nf4": the estimate's label
    quantizer: Quantizer

    def dequantized_rows(self, first_row: int) -> torch.Tensor:
        """This rank's rows of the [out, in] weight (the first of them global row `first_row`), dequantized,
        in `dtype`."""
        return self.quantizer.dequantized_rows(self, first_row)

    def load_rows(self, rows: torch.Tensor) -> None:
        """Quantize this rank's float rows of the weight into its shard. Collective for some formats
        (bitsandbytes' double quantization): call on every rank, in the same weight order."""
        self.quantizer.load_rows(self, rows)

    def transient_bytes(self, param_dtype: torch.dtype | None) -> int:
        """The largest temporary its matmul allocates (a dequantized copy of the whole weight)."""
        return self.quantizer.transient_bytes(self, param_dtype)


class Quantizer(Protocol):
    name: str

    def is_layer(self, module: nn.Module) -> bool:
        """A layer of this format, prepared or not (found without importing its library)."""

    def refuse_unsupported(self, model: nn.Module) -> None:
        """Refuse, by name, this library's layers hf_fsdp2 cannot shard (e.g. bitsandbytes 8-bit)."""

    def check_available(self) -> None:
        """Raise ImportError saying how to install the library."""

    def handles(self, quantization_config: Any) -> bool:
        """Whether a transformers `quantization_config` is this format's."""

    def quantize_on_meta(self, model: nn.Module, quantization_config: Any, dtype: torch.dtype) -> None:
        """A meta model turned into the quantized model `from_pretrained(quantization_config=...)` builds."""

    def prepare(self, model: nn.Module, dtype: torch.dtype | None) -> list[str]:
        """Every layer of this format given the row layout, in place (meta layers dequantize to `dtype`)."""

    def source_dtype(self, name: str, module: nn.Module) -> torch.dtype:
        """The float dtype an (unprepared) quantized layer dequantizes to, from its quantization state."""

    def weight_of(self, module: nn.Module) -> QuantizedWeight | None:
        """The prepared weight of `module`, None if it is not a prepared layer of this format."""

    def dequantized_rows(self, weight: QuantizedWeight, first_row: int) -> torch.Tensor: ...

    def load_rows(self, weight: QuantizedWeight, rows: torch.Tensor) -> None: ...

    def transient_bytes(self, weight: QuantizedWeight, param_dtype: torch.dtype | None) -> int: ...


def _implementations() -> tuple[Quantizer, ...]:
    from . import bnb_4bit  # here, not at the top: bnb_4bit builds QuantizedWeight (defined above)

    return (bnb_4bit.QUANTIZER,)


QUANTIZERS: tuple[Quantizer, ...] = _implementations()


def refuse_unsupported(model: nn.Module) -> None:
    for quantizer in QUANTIZERS:
        quantizer.refuse_unsupported(model)


def has_quantized_layers(model: nn.Module) -> bool:
    return any(q.is_layer(m) for m in model.modules() for q in QUANTIZERS)


def unprepared_layers(model: nn.Module) -> list[tuple[str, nn.Module, Quantizer]]:
    """(name, module, its quantizer) for every quantized layer not yet in the row layout."""
    return [(name, m, q) for name, m in model.named_modules() for q in QUANTIZERS
            if q.is_layer(m) and q.weight_of(m) is None]


def prepare(model: nn.Module, dtype: torch.dtype | None = None) -> list[str]:
    """Every quantized layer of `model` in the row layout FSDP2 shards; returns their names. Before
    `fully_shard` (and before a frozen-dtype cast, which would reinterpret packed bytes)."""
    return [name for q in QUANTIZERS for name in q.prepare(model, dtype)]


def is_prepared(module: nn.Module) -> bool:
    return any(q.weight_of(module) is not None for q in QUANTIZERS)


def weights(model: nn.Module) -> dict[int, QuantizedWeight]:
    """id(packed parameter) -> its prepared quantized weight, for every one of `model`."""
    found = {}
    for module in model.modules():
        for quantizer in QUANTIZERS:
            weight = quantizer.weight_of(module)
            if weight is not None:
                found[id(weight.packed)] = weight
    return found


def _quantizer_for(quantization_config: Any) -> Quantizer:
    for quantizer in QUANTIZERS:
        if quantizer.handles(quantization_config):
            return quantizer
    raise ValueError(f"`quantization_config` must be a BitsAndBytesConfig with load_in_4bit=True (QLoRA), got "
                     f"{type(quantization_config).__name__}: no other quantized base is sharded by hf_fsdp2.")


def check_available(quantization_config: Any) -> None:
    """ImportError naming how to install the library `quantization_config` needs."""
    _quantizer_for(quantization_config).check_available()


def quantize_on_meta(model: nn.Module, quantization_config: Any, dtype: torch.dtype) -> None:
    _quantizer_for(quantization_config).quantize_on_meta(model, quantization_config, dtype)


__all__ = ["QUANTIZERS", "QuantizedWeight", "Quantizer", "check_available", "has_quantized_layers", "is_prepared",
           "prepare", "quantize_on_meta", "refuse_unsupported", "unprepared_layers", "weights"]
