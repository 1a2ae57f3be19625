"""A model to shard, unwrapped once where it comes in: the object the caller holds (a `PeftModel`, or the
transformers model itself) and the transformers model under PEFT's wrappers. FSDP2 wraps the first (its
parameter names are the optimizer's and the checkpoint's); the second has what transformers defines (config,
`_no_split_modules`, TP/EP plans, embeddings, `_init_weights`). An entry point (`shard_planned`, the planner's
meta model, Accelerate's prepare, the record) makes one `ModelParts`; what it calls receives the parts it needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn


@dataclass(frozen=True)
class ModelParts:
    model: nn.Module  # as passed: a PeftModel or the transformers model
    base: nn.Module  # the transformers model (`model` itself without PEFT)

    @property
    def has_peft(self) -> bool:
        return self.base is not self.model

    # What a checkpoint reads of the adapters, read here so that no other module steps into PEFT's wrapper.
    # Properties, not fields: parts are made on every forward of some techniques, adapters are read at a save.

    @property
    def adapter_configs(self) -> dict:
        """The adapters' configs by name: a PeftModel's `peft_config`, or the one transformers' `add_adapter`
        sets on its own model; {} without adapters."""
        return getattr(self.model, "peft_config", {})

    @property
    def active_adapter(self) -> str:
        return getattr(self.model, "active_adapter", "default")

    def adapter_base_class(self, prompt_learning: bool) -> type:
        """The class adapter_config.json names as the adapter's base (`auto_mapping`), as PEFT's
        `PeftModel._get_base_model_class` (peft_model.py) gives it: the tuner's model, or the tuner itself
        for prompt learning (no tuner there: the base model)."""
        return self.model._get_base_model_class(is_prompt_tuning=prompt_learning)


def model_parts(model: nn.Module | ModelParts) -> ModelParts:
    """`model`'s parts (parts given stay as they are). PEFT is recognised on the class, duck-typed so the
    engine needs no peft import (PeftModel's `peft_config` is a property in PEFT 0.18-0.21): nn.Module's instance
    lookup of an absent name raises and catches an AttributeError, and records are read on every forward of
    some techniques."""
    if isinstance(model, ModelParts):
        return model
    cls = type(model)
    peft = hasattr(cls, "peft_config") and hasattr(cls, "get_base_model")
    return ModelParts(model, model.get_base_model() if peft else model)


__all__ = ["ModelParts", "model_parts"]
