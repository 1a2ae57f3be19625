"""bitsandbytes 4-bit (NF4/FP4, QLoRA) base weights that FSDP2 really shards.

bitsandbytes keeps a `Linear4bit` weight as a `Params4bit`: the packed 4-bit values of the row-major
[out, in] weight, flattened and viewed in `quant_storage`, with a `QuantState` (one absmax per
`blocksize` values, 8-bit quantized again under double quantization) attached to the tensor object.
FSDP2 shards parameters as plain data and keeps neither the subclass nor its state. So before
`fully_shard`, `prepare_4bit_modules` gives each `Linear4bit` plain uint8 parameters laid out by
output row:

    weight         [out, in/2]                packed values, two per byte
    weight_absmax  [out, 4 * in/blocksize]    each block's fp32 absmax, as bytes
                   [out, in/blocksize]        its 8-bit codes under double quantization

Why this layout:
- FSDP2 chunks dim 0, so a rank's shard is whole output rows, and with `in % blocksize == 0` whole
  quantization blocks (blocks are runs of `blocksize` consecutive values of the flattened weight).
  Blocks are quantized independently, so a rank can quantize its own rows of a bf16 checkpoint
  alone and get the bytes quantizing the whole weight gives (`quantize_rows`), and dequantize only
  its own rows for a merged save (`dequantize_rows`).
- uint8 parameters are outside FSDP2's mixed precision (`FSDPParam.init_dtype_attrs` leaves
  non-floating parameters uncast), so LoRA may compute in bf16 or fp32 whatever `quant_storage`
  was, and a group mixing uint8 and float parameters is all-gathered as bytes in one collective
  (`foreach_all_gather`: mixed dtypes -> uint8 views). The layer's packed weights, their absmax
  and its LoRA adapters are one group, one all-gather.
- Double quantization's second level (one fp32 absmax per 256 first-level values, the offset, the
  code books) is small (1/16384 of the values) and replicated as non-persistent buffers.

The forward rebuilds a `QuantState` from the gathered tensors and calls `bnb.matmul_4bit` as
`Linear4bit.forward` does, without that forward's in-place edits (a bias cast through `.data`, the
CPU inference repacking of the weight), which would replace FSDP2's unsharded tensors.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Iterator

import torch
import torch.nn as nn

from ..runtime import fsdp_state, upstream
from ..runtime.distributed import local_tensor
from .protocol import MetaQuantization, QuantizedWeight

INSTALL_HINT = "pip install 'bitsandbytes>=0.50' (or pip install -e '.[qlora]' in the hf_fsdp2 checkout)"
_SPEC = "_hf_fsdp2_4bit"  # where a prepared layer keeps its Quant4bitSpec (read through spec_of)
NESTED_BLOCKSIZE = 256  # bitsandbytes' double quantization: quantize_blockwise(absmax, blocksize=256)


def import_bitsandbytes():
    try:
        import bitsandbytes
    except ImportError as error:
        raise ImportError(f"4-bit (QLoRA) models need bitsandbytes: {INSTALL_HINT}") from error
    return bitsandbytes


def is_linear_4bit(module: nn.Module) -> bool:
    """A bitsandbytes `Linear4bit` (or subclass), found without importing bitsandbytes."""
    return any(cls.__name__ == "Linear4bit" and cls.__module__.startswith("bitsandbytes")
               for cls in type(module).__mro__)


def refuse_8bit_modules(model: nn.Module) -> None:
    """bitsandbytes 8-bit layers (`load_in_8bit`) keep their weight as `Int8Params` with row statistics
    (`SCB`) outside the tensor: FSDP2 would shard the int8 data as plain bytes and drop them. Refused by name."""
    names = [name for name, m in model.named_modules()
             if any(c.__name__ == "Linear8bitLt" and c.__module__.startswith("bitsandbytes") for c in type(m).__mro__)]
    if names:
        raise ValueError(f"bitsandbytes 8-bit layers (load_in_8bit) are not sharded by hf_fsdp2: {names[:3]}"
                         f"{' ...' if len(names) > 3 else ''}. Load the base in 4-bit (BitsAndBytesConfig("
                         "load_in_4bit=True), QLoRA, which hf_fsdp2 shards) or in bf16.")


def is_sharded_4bit(module: nn.Module) -> bool:
    return spec_of(module) is not None


def spec_of(module: nn.Module) -> Quant4bitSpec | None:
    """The spec of a `Linear4bit` that `prepare_4bit_modules` gave the row layout (else None)."""
    return module.__dict__.get(_SPEC)


@dataclasses.dataclass(frozen=True)
class Quant4bitSpec:
    """Everything about one 4-bit weight except its tensors."""

    out_features: int
    in_features: int
    blocksize: int
    quant_type: str  # "nf4" or "fp4"
    dtype: torch.dtype  # what dequantization returns: the weight's dtype when it was quantized
    nested: bool  # double quantization (`bnb_4bit_use_double_quant`)

    @property
    def packed_shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features // 2

    @property
    def absmax_shape(self) -> tuple[int, int]:
        blocks = self.in_features // self.blocksize
        return self.out_features, blocks if self.nested else 4 * blocks

    @property
    def num_blocks(self) -> int:
        return self.out_features * self.in_features // self.blocksize

    def check(self, name: str) -> None:
        if self.in_features % self.blocksize:
            raise ValueError(
                f"{name}: in_features={self.in_features} is not a multiple of the 4-bit blocksize "
                f"{self.blocksize}, so its rows do not hold whole quantization blocks and cannot be sharded "
                f"by row. Keep this module unquantized (BitsAndBytesConfig(llm_int8_skip_modules=[...])).")


def named_4bit_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    return ((name, m) for name, m in model.named_modules() if is_linear_4bit(m))


def prepare_4bit_modules(model: nn.Module, dtype: torch.dtype | None = None) -> list[str]:
    """Give every `Linear4bit` of `model` the row layout above, in place; returns their names.

    A quantized module keeps its exact bytes. A module on the meta device (a model built to be
    filled by `quantize_rows`) gets meta tensors of the layout and `dtype` as its dequantized dtype.
    Call before `fully_shard`."""
    names = []
    modules = list(named_4bit_modules(model))
    if modules and not fsdp_state.shards_integer_parameters():
        raise ValueError(f"4-bit base weights ({modules[0][0]}, ...) sharded by FSDP2 need torch >= 2.13; this is torch "
                         f"{torch.__version__}, whose fully_shard makes every parameter it shards require gradients, "
                         "which the packed uint8 4-bit weights cannot. Upgrade torch, or train LoRA over a bf16 base.")
    for name, module in modules:
        if is_sharded_4bit(module):
            continue
        if module.weight.is_meta:
            _convert_meta(module, name, dtype or torch.float32)
        else:
            _convert_quantized(module, name)
        names.append(name)
    return names


def _convert_quantized(module: nn.Module, name: str) -> None:
    bnb = import_bitsandbytes()
    weight = module.weight
    state = getattr(weight, "quant_state", None) or getattr(module, "quant_state", None)
    if state is None:
        raise ValueError(f"{name}: this Linear4bit holds unquantized weights (bitsandbytes quantizes on "
                         "`.to(device)`); load the model with `quantization_config=BitsAndBytesConfig("
                         "load_in_4bit=True, ...)` or move it to its device before sharding.")
    if getattr(state, "packing_format_for_cpu", False):  # repacked by an inference forward on CPU: undo
        data, state = bnb.nn.modules._convert_weight_packed_for_cpu_inverse(weight.data, state)
    else:
        data = weight.data
    out_features, in_features = state.shape
    spec = Quant4bitSpec(out_features, in_features, state.blocksize, state.quant_type, state.dtype, state.nested)
    spec.check(name)
    if state.state2 is not None and state.state2.blocksize != NESTED_BLOCKSIZE:
        raise ValueError(f"{name}: double quantization with blocksize {state.state2.blocksize} (bitsandbytes "
                         f"uses {NESTED_BLOCKSIZE}) is not supported.")
    packed = data.contiguous().view(torch.uint8).reshape(spec.packed_shape)
    if spec.nested:
        absmax = state.absmax.reshape(spec.absmax_shape)
    else:
        absmax = state.absmax.float().contiguous().view(torch.uint8).reshape(spec.absmax_shape)
    _install(module, spec, packed, absmax, state.code, state)


def _convert_meta(module: nn.Module, name: str, dtype: torch.dtype) -> None:
    bnb = import_bitsandbytes()
    weight = module.weight
    spec = Quant4bitSpec(module.out_features, module.in_features, weight.blocksize, weight.quant_type, dtype,
                         bool(weight.compress_statistics))
    spec.check(name)
    packed = torch.empty(spec.packed_shape, dtype=torch.uint8, device="meta")
    absmax = torch.empty(spec.absmax_shape, dtype=torch.uint8, device="meta")
    _install(module, spec, packed, absmax, bnb.functional.get_4bit_type(spec.quant_type, device="cpu"), None)


def _install(module: nn.Module, spec: Quant4bitSpec, packed: torch.Tensor, absmax: torch.Tensor,
             code: torch.Tensor, state) -> None:
    upstream.del_entry(module, "_parameters", "weight", "torch.nn.Module._parameters")
    module.register_parameter("weight", nn.Parameter(packed, requires_grad=False))
    module.register_parameter("weight_absmax", nn.Parameter(absmax, requires_grad=False))
    # Not persistent: our checkpoints never hold the packed base (the adapter, or dequantized
    # weights when merged); a loader fills these from the rows it quantizes.
    module.register_buffer("weight_quant_map", code.to(packed.device if not packed.is_meta else "cpu"),
                           persistent=False)
    if spec.nested:
        if state is not None:
            nested_absmax, nested_code, offset = state.state2.absmax, state.state2.code, state.offset
        else:
            import bitsandbytes.functional as F

            nested_absmax = torch.zeros(-(-spec.num_blocks // NESTED_BLOCKSIZE), dtype=torch.float32)
            nested_code, offset = F.create_dynamic_map(), torch.zeros((), dtype=torch.float32)
        module.register_buffer("weight_nested_absmax", nested_absmax, persistent=False)
        module.register_buffer("weight_nested_quant_map", nested_code, persistent=False)
        module.register_buffer("weight_offset", torch.as_tensor(offset, dtype=torch.float32), persistent=False)
    module.quant_state = None  # the old state's tensors are now ours; drop bitsandbytes' reference
    upstream.tag(module, _SPEC, spec)
    upstream.set_class(module, _sharded_class(type(module)), "bitsandbytes.nn.modules.Linear4bit.forward")


_CLASSES: dict[type, type] = {}


def _sharded_class(cls: type) -> type:
    """`cls` with the forward below; same name, so class-name lookups and isinstance checks hold."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(cls.__name__, (cls,), {"forward": _forward, "__module__": cls.__module__})
    return _CLASSES[cls]


def quant_state(module: nn.Module, packed: torch.Tensor | None = None, absmax: torch.Tensor | None = None,
                first_row: int = 0):
    """A bitsandbytes `QuantState` for `module`'s weight, or for the rows `packed`/`absmax` starting at
    `first_row` (whole blocks, so the nested absmax codes are decoded by their global block index)."""
    import bitsandbytes.functional as F

    spec: Quant4bitSpec = spec_of(module)
    packed = module.weight if packed is None else packed
    absmax = module.weight_absmax if absmax is None else absmax
    rows = packed.shape[0]
    shape = torch.Size([rows, spec.in_features])
    if not spec.nested:
        return F.QuantState(absmax=absmax.view(torch.float32).reshape(-1), shape=shape, code=module.weight_quant_map,
                            blocksize=spec.blocksize, quant_type=spec.quant_type, dtype=spec.dtype)
    if first_row == 0 and rows == spec.out_features:
        nested = F.QuantState(absmax=module.weight_nested_absmax, code=module.weight_nested_quant_map,
                              blocksize=NESTED_BLOCKSIZE, dtype=torch.float32)
        return F.QuantState(absmax=absmax.reshape(-1), shape=shape, code=module.weight_quant_map,
                            blocksize=spec.blocksize, quant_type=spec.quant_type, dtype=spec.dtype,
                            offset=module.weight_offset, state2=nested)
    # A row range: decode its absmax codes as `dequantize_blockwise` does (code[q] * absmax2[block // 256],
    # then + offset, dequantize_4bit's nested branch), then quantize the rows with a plain state.
    first_block = first_row * spec.in_features // spec.blocksize
    index = torch.arange(first_block, first_block + absmax.numel(), device=absmax.device) // NESTED_BLOCKSIZE
    decoded = module.weight_nested_quant_map[absmax.reshape(-1).long()] * module.weight_nested_absmax[index]
    decoded += module.weight_offset
    return F.QuantState(absmax=decoded, shape=shape, code=module.weight_quant_map, blocksize=spec.blocksize,
                        quant_type=spec.quant_type, dtype=spec.dtype)


def _forward(self, x: torch.Tensor) -> torch.Tensor:
    import bitsandbytes as bnb

    state = quant_state(self)
    if not self.compute_type_is_set:
        self.set_compute_type(x)
        self.compute_type_is_set = True
    input_dtype = x.dtype
    if self.compute_dtype is not None:
        x = x.to(self.compute_dtype)
    bias = None if self.bias is None else self.bias.to(x.dtype)
    return bnb.matmul_4bit(x, self.weight, bias=bias, quant_state=state).to(input_dtype)


def dequantize_rows(module: nn.Module, packed: torch.Tensor, absmax: torch.Tensor, first_row: int) -> torch.Tensor:
    """The [rows, in] weight of the rows `packed`/`absmax` hold (a rank's shard), in the spec's dtype."""
    import bitsandbytes.functional as F

    if packed.shape[0] == 0:
        return torch.empty(0, spec_of(module).in_features, dtype=spec_of(module).dtype)
    return F.dequantize_4bit(packed.reshape(-1, 1), quant_state(module, packed, absmax, first_row))


# ---------------------------------------------------------------------------------------------
# Quantizing while loading: each rank quantizes only its own rows


def quantize_rows(module: nn.Module, rows: torch.Tensor) -> torch.Tensor:
    """Quantize `rows` (this rank's [r, in] rows of the float weight) into the module's local packed
    shard; returns their fp32 absmax (one per block), which `finish_quantization` stores.

    The rows are cast to the spec's dtype first, as transformers casts a checkpoint tensor to the
    model's dtype before `Params4bit` quantizes it; whole blocks make the bytes those of the whole
    weight's quantization."""
    import bitsandbytes.functional as F

    spec: Quant4bitSpec = spec_of(module)
    packed = local_tensor(module.weight)
    if rows.shape[0] == 0:
        return torch.empty(0, dtype=torch.float32)
    quantized, state = F.quantize_4bit(rows.to(spec.dtype).contiguous(), blocksize=spec.blocksize,
                                       compress_statistics=False, quant_type=spec.quant_type,
                                       quant_storage=torch.uint8)
    packed[:rows.shape[0]].copy_(quantized.view(rows.shape[0], -1))
    return state.absmax.float()


def finish_quantization(module: nn.Module, absmax: torch.Tensor) -> None:
    """Store this rank's absmax; under double quantization first rebuild the whole weight's absmax
    (an all-gather over the shard group: the offset is the mean of all of them and the second-level
    blocks of 256 cross shard boundaries), quantize it as `quantize_4bit` does and keep own rows.
    Collective under double quantization: call on every rank, in the same module order."""
    import bitsandbytes.functional as F

    from ..runtime import collectives

    spec: Quant4bitSpec = spec_of(module)
    local = local_tensor(module.weight_absmax)
    rows = absmax.numel() // (spec.in_features // spec.blocksize)
    if not spec.nested:
        local[:rows].copy_(absmax.view(torch.uint8).view(rows, -1))
        return
    per_row = spec.in_features // spec.blocksize
    full = absmax
    weight = module.weight
    if hasattr(weight, "device_mesh") and weight.device_mesh.size(weight.device_mesh.ndim - 1) > 1:
        mesh = weight.device_mesh
        size = mesh.size(mesh.ndim - 1)
        chunk = -(-spec.out_features // size)
        padded = torch.zeros(chunk * per_row, dtype=torch.float32)
        padded[:absmax.numel()] = absmax
        pieces = collectives.all_gather_along(padded, mesh, mesh.ndim - 1)  # on the mesh's device
        counts = [max(0, min(chunk, spec.out_features - i * chunk)) * per_row for i in range(size)]
        full = torch.cat([piece[:n] for piece, n in zip(pieces, counts)])
        first = mesh.get_local_rank(mesh.ndim - 1) * chunk * per_row
    else:
        first = 0
    offset = full.mean()
    codes, nested = F.quantize_blockwise(full - offset, blocksize=NESTED_BLOCKSIZE)
    local[:rows].copy_(codes[first:first + rows * per_row].view(rows, per_row))
    module.weight_nested_absmax = nested.absmax.float()
    module.weight_nested_quant_map = nested.code
    module.weight_offset = offset.float()


def quantize_on_meta(model: nn.Module, quantization_config, dtype: torch.dtype) -> None:
    """Turn a meta-device transformers model into the 4-bit model `from_pretrained(...,
    quantization_config=...)` would build, without weights: transformers' own bitsandbytes quantizer
    picks the modules (not the output embedding, `llm_int8_skip_modules`, `_keep_in_fp32_modules`)
    and marks the model (`is_loaded_in_4bit`, which PEFT reads to pick its 4-bit LoRA layer)."""
    import_bitsandbytes()
    if not getattr(quantization_config, "load_in_4bit", False):
        raise ValueError("`quantization_config` must be a BitsAndBytesConfig with load_in_4bit=True "
                         "(8-bit models are not sharded by hf_fsdp2).")
    from transformers.quantizers.auto import AutoHfQuantizer

    quantizer = AutoHfQuantizer.from_config(quantization_config, pre_quantized=False)
    quantizer.preprocess_model(model=model, dtype=dtype, device_map={"": "cpu"})
    model.hf_quantizer = quantizer
    quantizer.postprocess_model(model)


# ---------------------------------------------------------------------------------------------
# The quantized-base interface (quantization/quantized.py): how the rest of hf_fsdp2 reaches this module


def dequantized_dtype(name: str, module: nn.Module, allowed: tuple[torch.dtype, ...]) -> torch.dtype:
    """The dtype an unprepared, quantized `Linear4bit` dequantizes to (its `QuantState`), one of `allowed`."""
    state = getattr(module.weight, "quant_state", None) or getattr(module, "quant_state", None)
    if module.weight.is_meta or state is None:
        raise ValueError(f"`fsdp_cpu_ram_efficient_loading`: rank 0's {name} holds no quantized weights; "
                         "load the model with from_pretrained(..., quantization_config=...) on rank 0.")
    if state.dtype not in allowed:
        raise ValueError(f"{name}: 4-bit weights that dequantize to {state.dtype} are not supported "
                         f"(one of {allowed}).")
    return state.dtype


class _Bnb4bit:
    """bitsandbytes NF4/FP4 `Linear4bit` layers, through the functions above."""

    name = "bitsandbytes 4-bit"
    SOURCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

    def is_layer(self, module: nn.Module) -> bool:
        return is_linear_4bit(module)

    def refuse_unsupported(self, model: nn.Module) -> None:
        refuse_8bit_modules(model)

    def check_available(self) -> None:
        import_bitsandbytes()

    def handles(self, quantization_config) -> bool:
        return type(quantization_config).__name__ == "BitsAndBytesConfig"

    def quantize_on_meta(self, model: nn.Module, quantization_config, dtype: torch.dtype) -> None:
        quantize_on_meta(model, quantization_config, dtype)

    def prepare(self, model: nn.Module, dtype: torch.dtype | None) -> list[str]:
        return prepare_4bit_modules(model, dtype)

    def source_dtype(self, name: str, module: nn.Module) -> torch.dtype:
        return dequantized_dtype(name, module, self.SOURCE_DTYPES)

    def weight_of(self, module: nn.Module):
        spec = spec_of(module)
        if spec is None:
            return None
        return QuantizedWeight(module, module.weight, (module.weight_absmax,), spec.out_features, spec.in_features,
                               spec.dtype, spec.quant_type, self)

    def dequantized_rows(self, weight, first_row: int) -> torch.Tensor:
        module = weight.module
        return dequantize_rows(module, local_tensor(module.weight), local_tensor(module.weight_absmax), first_row)

    def load_rows(self, weight, rows: torch.Tensor) -> None:
        finish_quantization(weight.module, quantize_rows(weight.module, rows))

    def transient_bytes(self, weight, param_dtype: torch.dtype | None) -> int:
        """bitsandbytes dequantizes the [out, in] weight into the input's dtype for the forward
        (`gemm_4bit`), and for the input gradient into the weight's original dtype, cast to the
        gradient's dtype; with double quantization the absmax is decoded to fp32 first."""
        spec: Quant4bitSpec = spec_of(weight.module)
        compute = weight.module.compute_dtype or param_dtype or spec.dtype
        numel = spec.out_features * spec.in_features
        size = spec.dtype.itemsize + (compute.itemsize if compute != spec.dtype else 0)
        return numel * size + (4 * spec.num_blocks if spec.nested else 0)

    def for_estimate(self, arguments: dict[str, Any]) -> MetaQuantization | None:
        """`load_in_4bit` / `bnb_4bit_use_double_quant`: NF4, as `BitsAndBytesConfig(load_in_4bit=True, ...)`."""
        load_in_4bit = arguments.pop("load_in_4bit", False)
        double_quant = arguments.pop("bnb_4bit_use_double_quant", False)
        if double_quant and not load_in_4bit:
            raise ValueError("`bnb_4bit_use_double_quant` is set without `load_in_4bit`; double quantization "
                             "applies to 4-bit weights only.")
        if not load_in_4bit:
            return None
        # one absmax per 64 weights: fp32 (4 bytes), or an 8-bit code under double quantization
        per_weight = ("0.515625 (0.5 packed + 1/64 absmax code)" if double_quant
                      else "0.5625 (0.5 packed + 4/64 fp32 absmax)")
        note = (f"4-bit (nf4): {per_weight} bytes per quantized weight / shard size, uint8 rows, frozen, "
                "gathered as their own bytes whatever param_dtype; code books"
                + (" and the second-level absmax" if double_quant else "") + " are replicated buffers.")
        return MetaQuantization(self, "load_in_4bit", bool(double_quant), note,
                                functools.partial(_estimate_config, bool(double_quant)), name="4-bit", storage="uint8")


def _estimate_config(double_quant: bool, compute_dtype: torch.dtype):
    """The config `estimate_memory(load_in_4bit=True)` costs: as hf_fsdp2.from_pretrained(...,
    quantization_config=...) would be given it for QLoRA."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=double_quant,
                              bnb_4bit_compute_dtype=compute_dtype)


QUANTIZER = _Bnb4bit()
