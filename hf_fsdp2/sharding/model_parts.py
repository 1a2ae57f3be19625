"""A model to shard, unwrapped once where it comes in: the object the caller holds (a `PeftModel`, or the
transformers model itself) and the transformers model under PEFT's wrappers. FSDP2 wraps the first (its
parameter names are the optimizer's and the checkpoint's); the second has what transformers defines (config,
`_no_split_modules`, TP/EP plans, embeddings, `_init_weights`). An entry point (`shard_planned`, the planner's
meta model, Accelerate's prepare, the record) makes one `ModelParts`; what it calls receives the parts it needs.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch.nn as nn


@dataclass(frozen=True)
class ModelParts:
    model: nn.Module  # as passed: a PeftModel or the transformers model
    base: nn.Module  # the transformers model (`model` itself without PEFT)
    # Fields, read once here where the parts are made: what the parts are handed to reads them without a call back
    # into this module. What a checkpoint reads of the adapters is read here so that no other module steps into
    # PEFT's wrapper: `adapter_configs`, the adapters' configs by name (a PeftModel's `peft_config`, or the one
    # transformers' `add_adapter` sets on its own model; {} without adapters; the live dict, which PEFT adds to);
    # `active_adapter`, the adapter a save writes.
    has_peft: bool = field(init=False, compare=False)
    adapter_configs: dict = field(init=False, compare=False, repr=False)
    active_adapter: str = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        # frozen: dataclasses' own way in (object.__setattr__, as its generated __init__ does for frozen fields)
        object.__setattr__(self, "has_peft", self.base is not self.model)
        object.__setattr__(self, "adapter_configs", _attribute(self.model, "peft_config", {}))
        object.__setattr__(self, "active_adapter", _attribute(self.model, "active_adapter", "default"))

    def adapter_base_class(self, prompt_learning: bool) -> type:
        """The class adapter_config.json names as the adapter's base (`auto_mapping`), as PEFT's
        `PeftModel._get_base_model_class` (peft_model.py) gives it: the tuner's model, or the tuner itself
        for prompt learning (no tuner there: the base model)."""
        return self.model._get_base_model_class(is_prompt_tuning=prompt_learning)

    def saved_adapter(self) -> SavedAdapter | None:
        """What adapter_config.json is written from (checkpoint/weights_io.py), read once where a save comes in:
        the active adapter's config (a copy) and the class `auto_mapping` names when it has no task type; None
        without adapters."""
        configs = self.adapter_configs
        if not configs:
            return None
        config = copy.deepcopy(configs[self.active_adapter])
        return SavedAdapter(config, None if config.task_type is not None
                            else self.adapter_base_class(config.is_prompt_learning))


@dataclass(frozen=True)
class SavedAdapter:
    config: object  # PEFT's config of the active adapter, a copy the save may change
    base_class: type | None  # `auto_mapping`'s base model class (None: a task type is set, no auto_mapping)


def _attribute(model: nn.Module, name: str, default):
    """`getattr(model, name, default)` without nn.Module's lookup of an absent name, which raises and catches an
    AttributeError (parts are made where some techniques run on every forward): on the class (PeftModel's
    `peft_config` property) or the instance (transformers' `add_adapter`, PeftModel's `active_adapter`)."""
    return getattr(model, name) if hasattr(type(model), name) or name in vars(model) else default


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


__all__ = ["ModelParts", "SavedAdapter", "model_parts"]
