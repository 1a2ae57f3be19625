"""transformers' own parallel plans, resolved for one model as `from_pretrained(distributed_config=...)` resolves
them: `PreTrainedModel._resolve_parallel_plans` (config overrides applied, `*` replaced by the layer numbers, one
entry per module or parameter). The one place hf_fsdp2 calls it (runtime/upstream.py PRIVATE); the technique that
asks takes its own plan from what transformers returns and words its own refusal."""

from __future__ import annotations

import torch.nn as nn


def resolve(model: nn.Module, refusal: str, **sizes: int) -> tuple[dict[str, str], ...]:
    """The plans of `model` (a transformers model, not a PEFT wrapper) for the sizes in `sizes` (DistributedConfig's
    fields), in transformers' order (transformers/distributed/mixin.py: tensor, expert, then FSDP's); a ValueError
    of `refusal` when the model has no plans."""
    from transformers.distributed import DistributedConfig

    resolver = getattr(model, "_resolve_parallel_plans", None)
    if resolver is None:
        raise ValueError(refusal)
    return tuple(resolver(DistributedConfig(**sizes)))


__all__ = ["resolve"]
