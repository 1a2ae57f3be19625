"""What a quantization format implements (`Quantizer`) and what the rest of hf_fsdp2 receives from it
(`QuantizedWeight`, `MetaQuantization`). Its own module so that a format (bnb_4bit.py) and the interface that
dispatches to the formats (quantized.py) both import it, neither the other: imports go one way."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol

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

    def for_estimate(self, arguments: dict[str, Any]) -> MetaQuantization | None:
        """The base an estimate's keywords ask for in this format (None: they ask for none), the keywords it
        reads taken out of `arguments`."""


@dataclasses.dataclass(frozen=True)
class MetaQuantization:
    """A quantized base as an estimate asks for it (`estimate_memory(load_in_4bit=True, ...)`), resolved by its
    format: all the planner knows of quantization. It builds the meta model as `from_pretrained(...,
    quantization_config=...)` would and says what a weight costs; the bytes themselves come from the prepared
    layers (`QuantizedWeight`)."""

    quantizer: Quantizer
    argument: str  # the keyword that asked for it (e.g. "load_in_4bit"), for the planner's errors
    double_quant: bool  # the scales quantized again (a field of the report)
    bytes_note: str  # what each quantized weight costs, for the estimate's notes
    quantization_config: Callable[[torch.dtype], Any]  # transformers' config, given the compute dtype
    name: str  # how the estimate's report names the base ("4-bit")
    storage: str  # what its rows are stored and gathered as ("uint8")

    def check_available(self) -> None:
        self.quantizer.check_available()

    def quantize_on_meta(self, model: nn.Module, dtype: torch.dtype, compute_dtype: torch.dtype) -> None:
        """`model` (on meta, weights of `dtype`) quantized as `from_pretrained` would, computing in `compute_dtype`."""
        self.quantizer.quantize_on_meta(model, self.quantization_config(compute_dtype), dtype)

    def prepare(self, model: nn.Module, dtype: torch.dtype | None) -> list[str]:
        return self.quantizer.prepare(model, dtype)


__all__ = ["MetaQuantization", "QuantizedWeight", "Quantizer"]
