"""FP8 training with FP8 all-gather (torchao float8, tensorwise dynamic scaling).

The decoder layers' `nn.Linear`s become torchao `Float8Linear`s with
`Float8LinearConfig(enable_fsdp_float8_all_gather=True)`: their weights stay in the training dtype
(fp32 masters: checkpoints are ordinary safetensors) wrapped in `WeightWithDynamicFloat8CastTensor`,
whose FSDP2 hooks (`fsdp_pre_all_gather`) cast each rank's shard to float8 before the all-gather.
A layer group then gathers float8 weights and fp32/bf16 norms together: FSDP2's `foreach_all_gather`
sees mixed dtypes and all-gathers their bytes as uint8 in one collective, which is also why it runs
on gloo, which has no float8 type. Linear weights move 1 byte per value instead of 2 (bf16) or 4.

The cast needs one scale per weight from the amax of the whole (sharded) weight. Without a
precomputed scale torchao all-reduces each weight's amax inside the all-gather hook (one extra
collective per linear); `precompute_scales` does all of them in one all-reduce. It runs after
sharding and after every optimizer step (`attach_to_optimizer`; the Accelerate backend hooks the
prepared optimizer, so a plain loop needs no extra line).

Not converted (reported by `convert`, kept for `conversion(model)`): modules outside the decoder layers
(embeddings, the output head: their precision matters most and they are not gathered per layer), LoRA's own adapter
layers (they train in bf16/fp32), 4-bit layers, and linears whose dimensions are not multiples of
16 (`torch._scaled_mm` needs them). LoRA base layers are converted: frozen base weights gather in
float8 with their scales in the same group as the adapters.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch
import torch.nn as nn

from ..runtime import fsdp_state, upstream
from ..runtime.distributed import reshard

INSTALL_HINT = "pip install 'torchao>=0.17' (or pip install -e '.[fp8]' in the hf_fsdp2 checkout)"
DIM_MULTIPLE = 16  # torch._scaled_mm: both dimensions of an FP8 matmul operand divisible by 16


def import_torchao():
    try:
        import torchao.float8
    except ImportError as error:
        raise ImportError(f"`fp8=True` needs torchao: {INSTALL_HINT}") from error
    return torchao.float8


def refuse_accelerate_backend(accelerator) -> None:
    """Accelerate's FP8 (`mixed_precision: fp8`) with the torchao backend is this module's: the layers' linears in
    FP8, FP8 all-gather. Another backend (Transformer Engine, MS-AMP) is refused by name."""
    if str(accelerator.mixed_precision) == "fp8":
        backend = str(getattr(accelerator, "fp8_backend", ""))
        if not backend.endswith("AO"):
            raise ValueError(f"`mixed_precision: fp8` with the {backend or 'default'} backend: hf_fsdp2 runs FP8 "
                             "through torchao only; set `fp8_config: backend: AO` (or AORecipeKwargs).")


@dataclasses.dataclass
class Fp8Conversion:
    converted: list[str]
    skipped: dict[str, str]  # module name -> why it stays in the training dtype

    def summary(self) -> str:
        lines = [f"FP8: {len(self.converted)} linear layers converted (FP8 all-gather)"]
        reasons: dict[str, list[str]] = {}
        for name, why in self.skipped.items():
            reasons.setdefault(why, []).append(name)
        for why, names in reasons.items():
            shown = ", ".join(names[:4]) + (f", ... ({len(names)} in all)" if len(names) > 4 else "")
            lines.append(f"  kept in the training dtype ({why}): {shown}")
        return "\n".join(lines)


def _skip_reason(name: str, module: nn.Module, in_layer: bool) -> str | None:
    if type(module) is not nn.Linear:  # Float8Linear already, 4-bit (a Linear subclass), other subclasses
        return f"not a plain nn.Linear ({type(module).__name__})"
    if ".lora_" in f".{name}":
        return "LoRA adapter"
    if not in_layer:
        return "outside the decoder layers"
    if module.in_features % DIM_MULTIPLE or module.out_features % DIM_MULTIPLE:
        return f"dimensions not multiples of {DIM_MULTIPLE}"
    return None


def plan(model: nn.Module, layers: list[nn.Module]) -> tuple[dict[str, nn.Module], dict[str, str]]:
    """(linears to convert by name, kept linears -> why) of `model`, whose decoder layers are `layers`.
    Pure: the memory estimator uses it without torchao."""
    inside = {id(m) for layer in layers for m in layer.modules()}
    chosen, skipped = {}, {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):  # torchao's swap considers every nn.Linear (subclasses too)
            why = _skip_reason(name, module, id(module) in inside)
            if why is None:
                chosen[name] = module
            else:
                skipped[name] = why
    return chosen, skipped


# What `convert` did to each model, kept here (the model's record names no technique): weakly, under the model and
# its decoder layers, so the model, a PeftModel around it or the base inside one finds it (`conversion`).
_CONVERSIONS: "weakref.WeakKeyDictionary[nn.Module, Fp8Conversion]" = weakref.WeakKeyDictionary()


def convert(model: nn.Module, layers: list[nn.Module]) -> Fp8Conversion:
    """Convert the eligible linears of `layers` (modules of `model`) in place; before `fully_shard`."""
    float8 = import_torchao()
    chosen, skipped = plan(model, layers)
    wanted = {id(m) for m in chosen.values()}
    config = float8.Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    float8.convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: id(m) in wanted)
    report = Fp8Conversion(list(chosen), skipped)
    for module in (model, *layers):
        _CONVERSIONS[module] = report
    return report


def conversion(model: nn.Module) -> Fp8Conversion | None:
    """What `convert` converted in `model` (or in a model inside it) and why it kept the rest; None when it never
    ran on it."""
    for module in model.modules():
        report = _CONVERSIONS.get(module)
        if report is not None:
            return report
    return None


def has_fp8(model: nn.Module) -> bool:
    return any(type(m).__name__ == "Float8Linear" for m in model.modules())


@torch.no_grad()
def precompute_scales(model: nn.Module) -> None:
    """One all-reduce for the scales of every FP8 weight of `model`. Collective: call on every rank.

    Every FSDP group is resharded first: torchao skips a `Float8Linear` whose weight is not a DTensor
    (`precompute_float8_dynamic_scale_for_fsdp`), which is what a group left unsharded by a forward
    without backward holds (the root, the last layer), so that group would keep stale scales."""
    if has_fp8(model):
        reshard(model)
        import_torchao().precompute_float8_dynamic_scale_for_fsdp(model)


def attach_to_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Precompute the FP8 scales after every `optimizer.step()` (once per optimizer)."""
    inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's AcceleratedOptimizer wraps one
    if not has_fp8(model) or getattr(inner, "_hf_fsdp2_fp8_hook", False):
        return
    inner.register_step_post_hook(lambda *args, **kwargs: precompute_scales(model))
    upstream.tag(inner, "_hf_fsdp2_fp8_hook", True)


FLOAT8_DTYPES = {torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz}


def _byte_view_all_gather():
    DefaultAllGather = upstream.subclass_base(
        "torch.distributed.fsdp._fully_shard._fsdp_collectives.DefaultAllGather.__call__")

    class ByteViewAllGather(DefaultAllGather):
        """gloo has no float8 type: its dtype dispatch (ProcessGroupGloo) raises "Invalid scalar type".
        FSDP2 all-gathers a group in one dtype, its inputs' own when they share one
        (`_get_all_gather_input_metadatas`), so a group whose inputs are all float8 weights (a layer
        without norms or biases) reaches gloo as float8. Its bytes are gathered instead; groups that
        mix dtypes are already gathered as uint8 by FSDP2 itself."""

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            if input_tensor.dtype in FLOAT8_DTYPES:
                output_tensor, input_tensor = output_tensor.view(torch.uint8), input_tensor.view(torch.uint8)
            return super().__call__(output_tensor, input_tensor, group, async_op)

    return ByteViewAllGather()


def gather_float8_as_bytes(model: nn.Module) -> None:
    """On gloo (CPU meshes): every FSDP group of `model` all-gathers float8 inputs as bytes."""
    from torch.distributed.fsdp import FSDPModule

    comm = _byte_view_all_gather()
    for module in model.modules():
        if isinstance(module, FSDPModule) and fsdp_state.param_groups(module._get_fsdp_state()):
            module.set_custom_all_gather(comm)
