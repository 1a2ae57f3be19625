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

vLLM weight sync (`use_vllm=True`): TRL walks the policy's parameters calling `full_tensor()` on
each, which on our models would hand vLLM packed 4-bit rows and PEFT names; instead a model we sharded
gives its weights as `save_pretrained` writes them (adapters merged, 4-bit dequantized, hub names),
one whole tensor at a time (checkpoint/full_weights.py).

Installed by the Accelerate backend when a trainer builds its Accelerator and TRL is imported
(runtime/upstream.py seams `trl.models.utils.prepare_fsdp`, rebound in TRL's trainer modules, and
`VLLMGeneration._iter_named_params`, TRL >= 1.x's one place for the weight walk).
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch.nn as nn

from ..runtime import upstream

GROUP = "trl"
TARGET = "trl.models.utils.prepare_fsdp"
VLLM_TARGET = "trl.generation.vllm_generation.VLLMGeneration._iter_named_params"


# What the Accelerate backend gives at install (no import of it from here: it imports this module).
_prepare_for_inference: Callable[[Any, nn.Module], nn.Module] | None = None


def install_if_imported(prepare_for_inference: Callable[[Any, nn.Module], nn.Module]) -> None:
    """Idempotent; each seam once its TRL module is loaded (TRL's trainers import them).
    `prepare_for_inference(accelerator, model)`: how the backend shards a model that only runs forwards."""
    global _prepare_for_inference
    _prepare_for_inference = prepare_for_inference
    if "trl.models.utils" in sys.modules:
        upstream.replace(TARGET, _prepare_fsdp, GROUP)
    vllm_generation = sys.modules.get("trl.generation.vllm_generation")
    if hasattr(getattr(vllm_generation, "VLLMGeneration", None), "_iter_named_params"):
        upstream.replace(VLLM_TARGET, _iter_named_params, GROUP)


def uninstall() -> None:
    global _prepare_for_inference
    upstream.restore(GROUP)
    _prepare_for_inference = None


def _prepare_fsdp(model: nn.Module, accelerator):
    if not getattr(accelerator, "is_fsdp2", False) or _prepare_for_inference is None:
        return upstream.original(TARGET)(model, accelerator)
    return _prepare_for_inference(accelerator, model)


def _iter_named_params(self):
    """`VLLMGeneration._iter_named_params` (a generator of (name, whole tensor), collective)."""
    from ..checkpoint.full_weights import full_weights
    from ..sharding import is_sharded, model_parts, record_of

    if not is_sharded(self.model):
        yield from upstream.original(VLLM_TARGET)(self)
        return
    yield from full_weights(model_parts(self.model), record_of(self.model).mesh)
