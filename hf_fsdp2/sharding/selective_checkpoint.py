"""Op-level selective activation checkpointing: a checkpointed decoder layer keeps the outputs of its
matmuls and attention and recomputes only the cheap ops (norms, activations, elementwise) in backward.

torchtitan's `selective_ac_option="op"` (and the example of torch's `create_selective_checkpoint_contexts`):
the ops whose recomputation costs the most FLOPs are saved (`CheckpointPolicy.MUST_SAVE`), everything
else is recomputed (`PREFER_RECOMPUTE`). Memory: more than checkpointing the whole layer (the matmul
and attention outputs stay), far less than no checkpointing (the norms', activations' and
elementwise ops' outputs go); compute: a few percent more instead of a whole forward of the layer.
`FSDP2Config(activation_checkpointing=True, checkpoint_save_matmuls=True)`; the estimate counts what
the saved ops output in each layer (activation_trace.py) and the planner offers it before
checkpointing whole layers.
"""

from __future__ import annotations

import torch

# What a decoder layer's expensive ops are at the aten level: its linears (mm / addmm, bmm for batched
# projections) and the fused attention kernels (those this torch build has).
SAVED_OPS = frozenset(getattr(torch.ops.aten, name).default for name in (
    "mm", "addmm", "bmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
) if hasattr(torch.ops.aten, name))


def _policy(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def context_fn():
    """`torch.utils.checkpoint.checkpoint(..., context_fn=context_fn)`: the (forward, recompute) contexts."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_policy)


def checkpointed_layers(layers: list, every: int) -> list:
    """The layers activation checkpointing recomputes: 0, every, 2 x every, ... (`checkpoint_every`); the one
    rule the engine, the estimator and compile="model"'s graph pass share."""
    return [layer for index, layer in enumerate(layers) if index % every == 0]


def checkpoint_kwargs(save_matmuls: bool) -> dict:
    """Keyword arguments for `checkpoint_wrapper` (passed on to torch's checkpoint)."""
    return {"context_fn": context_fn} if save_matmuls else {}


# A decoder layer's KV cache argument (transformers 5: `past_key_values`; earlier: `past_key_value`).
_CACHE_ARGS = ("past_key_values", "past_key_value")


def without_cache_in_training(wrapper) -> None:
    """A training forward of the checkpointed layer gets no KV cache. Selective checkpointing replays
    the layer's ops against what forward recorded, and a cache the forward filled makes the recompute
    run other ops (the keys come back twice as long and are sliced), which torch refuses ("not found in
    storage"). Whole-layer checkpointing tolerates it, which is why a model-level `use_cache=False`
    (compile.disable_cache_in_training) is not relied on here: transformers may still build a cache."""
    def hook(module, args, kwargs):
        if module.training:
            for name in _CACHE_ARGS:
                if kwargs.get(name) is not None:
                    kwargs[name] = None
        return args, kwargs

    wrapper.register_forward_pre_hook(hook, with_kwargs=True)


__all__ = ["SAVED_OPS", "checkpoint_kwargs", "checkpointed_layers", "context_fn", "without_cache_in_training"]
