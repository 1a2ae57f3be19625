"""Regional compilation: each decoder layer compiled on its own before `fully_shard`.

torchtitan's `apply_compile` is the model (per-block `torch.compile(..., fullgraph=True)` after
activation checkpointing, before FSDP). Like Accelerate's `compile_regions_fsdp2` we compile in
place (`nn.Module.compile`, which sets `_compiled_call_impl`) rather than wrapping each layer in an
`OptimizedModule`: parameter names stay those of the model (no `_orig_mod.`), so checkpoints are
unchanged, and FSDP2's hooks, which run `torch._dynamo.disable`d (`_fsdp_common._dynamo_disable`),
stay outside the graphs. Layers of one class run the same code, so with dynamo's default
`inline_inbuilt_nn_modules` their parameters are graph inputs and one compiled graph serves every
layer. What would specialise a graph per layer is a per-layer constant the forward reads: in a
training forward that is the KV cache (`past_key_values.update(..., self.layer_idx)`), so training
forwards run without one (`disable_cache_in_training`), as transformers' gradient checkpointing does.

Unlike torchtitan we do not pass `fullgraph=True`: evaluation and `generate` run the same compiled
layers with a KV cache, which dynamo cannot trace whole ("'DynamicLayer' object has no attribute
'dtype'" under fullgraph); without it those forwards fall back to eager where they must, while the
training forward is one graph per layer class (tests/test_layout.py counts zero graph breaks).
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any

import torch.nn as nn

from ..model_parts import ModelParts

# The transformers models whose training forwards run without a cache (`disable_cache_in_training` ran): weakly
# held, so a model garbage-collected leaves.
_WITHOUT_CACHE: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def is_compiled(module: nn.Module) -> bool:
    return getattr(module, "_compiled_call_impl", None) is not None


def compile_layers(layers: list[nn.Module], **compile_kwargs: Any) -> None:
    """Compile each layer in place (a layer already compiled, e.g. by Accelerate's regional
    compilation, is left as it is)."""
    kwargs = {"fullgraph": False, **compile_kwargs}
    for layer in layers:
        if not is_compiled(layer):
            layer.compile(**kwargs)


def disable_cache_in_training(parts: ModelParts) -> None:
    """Training forwards of `model` run with `use_cache=False`, as transformers' gradient checkpointing
    does: a cache filled in forward is filled again by a checkpointed layer's recomputation, and it
    would specialise a compiled layer's graph per layer. Evaluation and `generate` keep the cache, and
    the config is untouched, so a saved config.json is what stock writes. A model whose forward takes
    no `use_cache` argument gets `config.use_cache = False` instead (text config too). Idempotent: the
    transformers model is remembered (a PeftModel and its base are one model here)."""
    base = parts.base
    if base in _WITHOUT_CACHE:
        return
    _WITHOUT_CACHE.add(base)
    if "use_cache" not in inspect.signature(base.forward).parameters:
        config = getattr(base, "config", None)
        for cfg in (config, getattr(config, "get_text_config", lambda: None)()):
            if getattr(cfg, "use_cache", False):
                cfg.use_cache = False
        return

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if module.training:
            kwargs["use_cache"] = False
        return args, kwargs

    parts.model.register_forward_pre_hook(hook, with_kwargs=True)


__all__ = ["compile_layers", "disable_cache_in_training", "is_compiled"]
