"""What the rest of hf_fsdp2 needs from a quantized base, in one small interface.

A quantized base keeps each quantized linear's weight as packed rows that FSDP2 shards by dim 0 like any
parameter, with per-row side data (scales) sharded beside it, so a rank's shard is whole rows and it can
quantize or dequantize its own rows alone. Sharding, the planner, loading and export reach a quantized
base only through this module:

- sharding (sharding/engine.py, tensor_parallel.py, compile/compiled_collectives.py): `refuse_unsupported`,
  `prepare` (the row layout, before `fully_shard`), `has_quantized_layers` (a technique not done with a
  quantized base refuses it by name);
- estimating (planner/memory.py): `for_estimate` (the base its keywords ask for, as a `MetaQuantization`:
  built on meta, prepared, its bytes described; the planner names no format), `has_quantized_layers`,
  `weights` (per weight its logical shape and its matmul's transient bytes);
- loading (checkpoint/loading.py, pretrained.py, weights_io.py): `quantize_on_meta`, `prepare`,
  `unprepared_layers`, `source_dtype`, `QuantizedWeight.load_rows`;
- export (checkpoint/export_plan.py, lora_merge.py): `weights`, `is_prepared`,
  `QuantizedWeight.dequantized_rows`.

bitsandbytes 4-bit (quantization/bnb_4bit.py) is the first implementation; another (torchao int4, HQQ)
implements `Quantizer` (quantization/protocol.py, which the formats import, never this module) and joins
`QUANTIZERS`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from . import bnb_4bit
from .protocol import MetaQuantization, QuantizedWeight, Quantizer

QUANTIZERS: tuple[Quantizer, ...] = (bnb_4bit.QUANTIZER,)


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


def for_estimate(**arguments) -> MetaQuantization | None:
    """The quantized base an estimate's keywords ask for (`estimate_memory`'s `load_in_4bit=True`,
    `bnb_4bit_use_double_quant=...`): each format reads its own; None when they ask for none. The planner
    builds and costs it through the result, knowing no format."""
    left = dict(arguments)
    found = [setup for quantizer in QUANTIZERS if (setup := quantizer.for_estimate(left)) is not None]
    if left:  # a keyword no format reads would be dropped
        raise TypeError(f"unknown quantization argument(s) {sorted(left)}: no quantized base reads them.")
    if len(found) > 1:
        raise ValueError(f"{' and '.join(f'`{s.argument}`' for s in found)} both ask for the quantized base; "
                         "choose one.")
    return found[0] if found else None


__all__ = ["QUANTIZERS", "MetaQuantization", "QuantizedWeight", "Quantizer", "check_available", "for_estimate",
           "has_quantized_layers", "is_prepared", "prepare", "quantize_on_meta", "refuse_unsupported",
           "unprepared_layers", "weights"]
