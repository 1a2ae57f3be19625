"""TRL: every model a TRL trainer prepares is sharded by hf_fsdp2.

TRL's trainers shard the models they hold beside the policy (DPO/KTO/RLOO/GRPO reference models,
online DPO's, SDPO/SDFT teachers and reward models) with `trl.models.utils.prepare_fsdp`: under FSDP2
one `fully_shard` at the root, so every forward all-gathers the whole model at once, the memory of a
full replica. With hf_fsdp2 registered, those models get the policy's treatment: per-layer groups,
the Accelerate config's precision and layout, frozen (no gradients, no optimizer state: they are
only ever run under no_grad), and every group resharded after its forward (nothing stays gathered
between steps). A PEFT policy's "adapter disabled" reference needs no second model and
is untouched. Generation on them (and on the policy) gathers each group once per `generate()` call
(sharding/generation.py). Reward models TRL prepares with Accelerate's `prepare_model(...,
evaluation_mode=True)` get the same treatment there (integrations/accelerate.py `_prepare_model`).

Installed by the Accelerate backend when a trainer builds its Accelerator and TRL is imported
(runtime/upstream.py seam `trl.models.utils.prepare_fsdp`, rebound in TRL's trainer modules).
"""

from __future__ import annotations

import sys

import torch.nn as nn

from ..runtime import upstream

GROUP = "trl"
TARGET = "trl.models.utils.prepare_fsdp"


def install_if_imported() -> None:
    """Idempotent; only once TRL's model utilities are loaded (TRL's trainers import them)."""
    if "trl.models.utils" in sys.modules and not upstream.installed(GROUP):
        upstream.replace(TARGET, _prepare_fsdp, GROUP)


def uninstall() -> None:
    upstream.restore(GROUP)


def _prepare_fsdp(model: nn.Module, accelerator):
    from . import accelerate as backend

    if not getattr(accelerator, "is_fsdp2", False) or not backend.is_registered():
        return upstream.original(TARGET)(model, accelerator)
    return backend.prepare_for_inference(accelerator, model)
