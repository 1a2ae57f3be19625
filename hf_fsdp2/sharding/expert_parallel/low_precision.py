"""The experts' grouped matmuls in low precision through torchao's MoE training (`FSDP2Config.fp8_experts`, issue 64).

torchao (torchao/prototype/moe_training) trains grouped experts with dynamic quantization: its autograd functions
quantize a projection's rows and the experts' weights at each call and run a scaled grouped matmul for the
output, the input gradient and the weight gradient (`_quantize_then_scaled_grouped_mm`, which dispatches on its
config: `Float8TrainingOpConfig`, rowwise FP8 through `torch._scaled_grouped_mm`, CUDA compute capability 9.x;
`MXFP8TrainingOpConfig`, MXFP8 blocks of 32, capability 10.x, or `KernelPreference.EMULATED`: quantize, dequantize
into a bf16 grouped matmul, any device). Weights, optimizer states and checkpoints keep their dtype.

torchao reaches that function from its weight wrapper tensors' `__torch_function__`, by the name "_grouped_mm"
(tensor.py). transformers' `_grouped_mm` calls `torch.nn.functional.grouped_mm` on torch >= 2.10, which calls
`torch._grouped_mm`, so a wrapped weight would reach it; but under expert parallelism transformers swaps each
experts parameter for its local rows for the call (`_use_local_dtensor_params`) and FSDP2 owns the parameters, so
hf_fsdp2 wraps nothing: the EP dispatch's `grouped_experts` calls the matmul registered here for the experts'
projections (`dispatch.use_matmul`), which calls torchao's function with the mode's config. The LoRA terms beside
it ((x @ A) @ (scaling B), adapters in their dtype) stay in transformers' grouped matmul; a frozen base then runs
in FP8 as a trained one does (torchao's functions quantize dynamically, nothing is stored quantized), its weight
gradient computed by torchao and dropped by autograd (not skipped: not done).

Token groups: the kernels read each expert's rows along the weight gradient's inner dimension, so every group
starts at a multiple of 16 rows (rowwise: 16 bytes of FP8) or 32 (MXFP8's block), and an empty group gets one block of
zero rows, as torchtitan pads them. torchao
pads only with a CUDA kernel, or on the host (`tolist`); here the rows are moved to padded places on the device
(`_pad_groups`: offsets, a searchsorted and an index_copy, no host read) and back after the matmul: one copy of the
rows and one of the output each way, the cost over a bf16 grouped matmul besides torchao's quantization. The EP
dispatch's unused rows past the last group go past the last padded group, where the kernels write nothing defined
(torchao's emulation, CUDA's grouped matmuls): as with transformers' grouped matmul there, those rows' outputs and
gradients are garbage the dispatch never reads (its embedding and embedding_bag skip them), so they are not masked
(two passes over the rows fewer; nothing is summed over them).

Without EP (ep_size 1, `install_whole`) each experts module's forward runs sharding/expert_parallel/grouped.py's
steps (transformers' `grouped_mm_experts_forward`: sort, offsets, weighting) around the same `grouped_experts`, so the
same registered matmul runs; PEFT's wrappers call it with the adapters inside, or call the experts.

Refused by name (`check_setting`, `install`, `install_whole`, at the call): torchao missing or older than 0.17, a
device that cannot run the mode (rowwise: CUDA capability >= 9.0 and Triton; mxfp8: >= 10.0 with torchao's SM100
kernels; only mxfp8_emulated runs on CPU), experts not run by those grouped matmuls (transformers' AllToAllEP, the
batched_mm or deepgemm implementations, also when set after sharding), a model without transformers experts,
dimensions that are not multiples of 16 (rowwise) or 32 (MXFP8), and weights in float16 (torchao takes bf16 or fp32);
FSDP2Config refuses `compile` and `tp_size` with it. Not done: rows laid out at padded places by the dispatch's and
grouped.py's own gathers (the copies above fewer), FP8 all-gather of the experts' weights, skipping the frozen base's
weight gradient.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...runtime import upstream, versions
from . import dispatch, grouped, lora

TORCHAO_OLDEST = (0, 17)  # the first with both configs and `_quantize_then_scaled_grouped_mm(A, B_t, config, offs)`
INSTALL_HINT = "pip install 'torchao>=0.17'"
SETTING = "fp8_experts"
EXPERTS_FORWARD = "transformers.integrations.moe.grouped_mm_experts_forward"  # what `_whole` runs in its place


@dataclasses.dataclass(frozen=True)
class Mode:
    align: int  # rows per token group and the experts' dimensions: multiples of this
    capability: tuple[int, int] | None  # the CUDA compute capability it needs; None: any device (emulated)
    kernels: str  # what runs it, as a refusal says


MODES = {
    "rowwise": Mode(16, (9, 0), "torch._scaled_grouped_mm's rowwise FP8 kernels (CUDA compute capability >= 9.0)"),
    "mxfp8": Mode(32, (10, 0), "torchao's MXFP8 SM100 kernels (CUDA compute capability >= 10.0)"),
    "mxfp8_emulated": Mode(32, None, "MXFP8 quantization dequantized into a bf16 grouped matmul (any device)"),
}


def _named(mode: str) -> str:
    return f"`{SETTING}`={mode!r}"


def check_setting(mode: str, device_type: str) -> None:
    """torchao and the device can run `mode`, or a ValueError naming the setting."""
    version = versions.installed("torchao")
    if version is None or versions.parse(version) < TORCHAO_OLDEST:
        raise ValueError(f"{_named(mode)} runs torchao's MoE training grouped matmuls: torchao "
                         f"{version or 'is not installed'}{' is installed' if version else ''}; {INSTALL_HINT}.")
    needs = MODES[mode].capability
    if needs is None:
        return
    if device_type != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"{_named(mode)} needs {MODES[mode].kernels}; this device is {device_type}. "
                         "On CPU only 'mxfp8_emulated' runs.")
    have = torch.cuda.get_device_capability()
    if have < needs:
        raise ValueError(f"{_named(mode)} needs {MODES[mode].kernels}; this GPU has {have[0]}.{have[1]}"
                         + (" (use 'rowwise')." if mode == "mxfp8" and have >= MODES["rowwise"].capability else "."))
    if mode == "rowwise" and importlib.util.find_spec("triton") is None:  # torchao's rowwise quantization kernels
        raise ValueError(f"{_named(mode)} quantizes with torchao's Triton kernels: triton is not installed.")
    if mode == "mxfp8":
        from torchao.prototype.moe_training import mxfp8_grouped_mm

        if not getattr(mxfp8_grouped_mm, "_SM100_KERNELS_AVAILABLE", False):
            raise ValueError(f"{_named(mode)}: this torchao build has no SM100 MXFP8 kernels (a CUDA 12.8+ build).")


@functools.cache
def torchao_config(mode: str):
    """torchao's config of `mode` (output in bf16: `torch._scaled_grouped_mm` and the CPU grouped matmul of the
    emulation write bf16 only; the caller casts back)."""
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig, MXFP8TrainingOpConfig
    from torchao.quantization.quantize_.common import KernelPreference

    if mode == "rowwise":
        return Float8TrainingOpConfig(out_dtype=torch.bfloat16, pad_token_groups_for_grouped_mm=False)
    preference = KernelPreference.EMULATED if mode == "mxfp8_emulated" else KernelPreference.AUTO
    return MXFP8TrainingOpConfig(kernel_preference=preference, out_dtype=torch.bfloat16,
                                 pad_token_groups_for_grouped_mm=False)


def install(experts_modules: list[nn.Module], mode: str | None, device_type: str) -> None:
    """The grouped matmuls of `experts_modules` (split by EP, run by its dispatch) through torchao in `mode`."""
    if mode is None:
        return
    check_setting(mode, device_type)
    for experts in experts_modules:
        if not dispatch.takes_adapters(experts):
            raise ValueError(f"{_named(mode)} runs in hf_fsdp2's EP dispatch with experts_implementation="
                             f"'grouped_mm'; {type(experts).__name__} runs elsewhere (another experts "
                             "implementation, or transformers' AllToAllEP: dispatch.set_dispatch('all_to_all')).")
        _register(experts, mode)


def install_whole(base: nn.Module, mode: str | None, device_type: str) -> list[str]:
    """Without EP (ep_size 1): every transformers experts module of `base` runs `grouped.forward` (transformers'
    `grouped_mm_experts_forward` step for step, the experts through the dispatch's `grouped_experts`) with torchao's
    matmul in `mode`; PEFT's wrappers around them call it too (grouped.py with the adapters inside, or PEFT's own
    forward, which calls the experts). The names of the experts modules."""
    if mode is None:
        return []
    check_setting(mode, device_type)
    names = []
    for name, experts in base.named_modules():
        if lora._is_param_wrapper(experts) or not hasattr(experts, "has_gate"):  # transformers' experts classes
            continue
        if not grouped.runs_here(experts):
            raise ValueError(f"{_named(mode)} runs transformers' grouped_mm experts implementation; {name} "
                             f"({type(experts).__name__}) is set to another one.")
        _register(experts, mode)
        upstream.wrap_instance_method(experts, "forward", EXPERTS_FORWARD,
                                      lambda original, experts=experts: functools.partial(_whole, experts, mode))
        names.append(name)
    if not names:
        raise ValueError(f"{_named(mode)}: {type(base).__name__} has no transformers experts module (fused "
                         "gate_up_proj / down_proj run by transformers' experts implementations) to run in FP8.")
    return names


def _whole(experts: nn.Module, mode: str, hidden_states, top_k_index, top_k_weights):
    """The experts' forward without EP: `grouped.forward` (the matmul `_register` set), or a refusal by name where
    the experts implementation changed after sharding (it would not run)."""
    if not grouped.runs_here(experts):
        raise ValueError(f"{_named(mode)} runs in the grouped_mm experts implementation, not "
                         f"{experts.config._experts_implementation!r}; set it back to 'grouped_mm'.")
    return grouped.forward(experts, hidden_states, top_k_index, top_k_weights)


def _register(experts: nn.Module, mode: str) -> None:
    """torchao's matmul for the projections of `experts` in the dispatch's `grouped_experts`, its dimensions checked."""
    align = MODES[mode].align
    for name in ("gate_up_proj" if experts.has_gate else "up_proj", "down_proj"):
        weight = getattr(experts, name)
        if any(size % align for size in weight.shape[1:]):
            raise ValueError(f"{_named(mode)} with {type(experts).__name__}.{name} of shape "
                             f"{tuple(weight.shape)}: its kernels need both matrix dimensions multiples of "
                             f"{align}; not done.")
    dispatch.use_matmul(experts, functools.partial(grouped_mm, mode), _named(mode))


def grouped_mm(mode: str, rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """rows @ weight[e] for each expert's group of rows (`weight` [E, in, out], `offsets` the groups' int32 ends,
    rows past the last one unused) through torchao's quantized grouped matmul, in the rows' dtype."""
    from torchao.prototype.moe_training.utils import _quantize_then_scaled_grouped_mm

    if weight.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"{_named(mode)} with expert weights in {weight.dtype}: torchao's grouped matmuls take "
                         "bfloat16 or float32 (param_dtype bf16).")
    dtype = rows.dtype
    rows = rows.to(weight.dtype).contiguous()
    if weight.stride(-2) != 1:  # [E, in, out] stored row-major (is_transposed experts): the kernels read column-major
        weight = weight.transpose(-2, -1).contiguous().transpose(-2, -1)
    padded, places, ends = _pad_groups(rows, offsets, MODES[mode].align)
    out = _quantize_then_scaled_grouped_mm(padded, weight, torchao_config(mode), offs=ends)
    return out.index_select(0, places).to(dtype)


def _pad_groups(rows: torch.Tensor, offsets: torch.Tensor, align: int):
    """`rows` with each group moved to start at a multiple of `align` (zero rows between), on the device: the padded
    rows, each row's place in them, and the padded groups' int32 ends. The rows past the last group (unused) follow
    the last padded group. The padded count is known on the host: rows + groups x align, rounded up."""
    count, groups = rows.shape[0], offsets.shape[0]
    ends = offsets.long()
    sizes = torch.diff(ends, prepend=ends.new_zeros(1))
    # at least one block per group, an empty one too (zero rows: zero output, zero weight gradient), as torchtitan pads
    # them: the kernels then never see an empty group
    padded_ends = torch.cumsum(torch.div(sizes + align - 1, align, rounding_mode="floor").clamp_min(1) * align, 0)
    # each group's rows move by (its padded start - its start); the unused rows past it by the last group's end's
    shifts = F.pad(padded_ends - ends, (1, 0))
    index = torch.arange(count, device=rows.device)
    places = index + shifts[torch.searchsorted(ends, index, right=True)]
    total = -(-(count + groups * align) // align) * align
    padded = rows.new_zeros(total, rows.shape[1]).index_copy_(0, places, rows)  # in place: no clone of the zeros
    return padded, places, padded_ends.to(torch.int32)


__all__ = ["MODES", "check_setting", "grouped_mm", "install", "install_whole", "torchao_config"]
