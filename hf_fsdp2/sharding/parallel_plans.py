"""transformers' own parallel plans (TP, EP), resolved for one model as `from_pretrained(distributed_config=...)`
resolves them: `PreTrainedModel._resolve_parallel_plans` (config overrides applied, `*` replaced by the layer
numbers, one entry per module or parameter). The one place hf_fsdp2 calls it (runtime/upstream.py PRIVATE)."""

from __future__ import annotations

import torch.nn as nn


def resolve(model: nn.Module, setting: str, value: int, **sizes: int) -> tuple[dict[str, str], dict[str, str]]:
    """(tp_plan, ep_plan) of `model` (a transformers model, not a PEFT wrapper) for the sizes in `sizes`
    (DistributedConfig's fields); `setting`=`value` names what asked for them in the error when the model has
    no plans."""
    from transformers.distributed import DistributedConfig

    resolver = getattr(model, "_resolve_parallel_plans", None)
    if resolver is None:
        kind = "tensor" if setting == "tp_size" else "expert"
        raise ValueError(f"`{setting}`={value}: {type(model).__name__} is not a transformers model with a "
                         f"{kind}-parallel plan.")
    tp_plan, ep_plan, _ = resolver(DistributedConfig(**sizes))
    return tp_plan, ep_plan


__all__ = ["resolve"]
