"""A model hf_fsdp2 sharded before `prepare` (`hf_fsdp2.from_pretrained`: no rank ever holds the whole
model), then given to `accelerator.prepare` or the Trainer: kept as it is, never sharded twice.

Its layout was fixed when it was sharded, so the settings Accelerate (its yaml, the Trainer's arguments)
asks for are checked against those it was sharded with: a setting that would be ignored is refused by
name, with the `FSDP2Config` to load it with instead. Only `async_save`, which acts at save time, is taken
from Accelerate's settings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Iterator

import torch.nn as nn

from ..config import UNSET_AGREES_AT_PREPARE, FSDP2Config
from ..runtime import collectives
from ..sharding import ShardedModel, engine, record_of, replication

# Inputs of the layout planner (shard_size="auto"), spent once the layout is chosen.
_PLANNING = ("memory_budget", "plan_batch_size", "plan_seq_len")
_AT_SAVE = ("async_save",)
# DDP's reducer settings (the Trainer passes find_unused_parameters): they act only on a model replicated
# with DDP's reducer (sharding/replication.py); FSDP2 groups take none, as when prepare shards the model.
_REDUCER_ONLY = ("find_unused_parameters", "bucket_cap_mb")


def differing_settings(have: FSDP2Config, wanted: FSDP2Config, *, on_reducer: bool) -> dict[str, tuple]:
    """field -> (what the model was sharded with, what Accelerate asks) for every setting that differs and
    cannot change on a sharded model. Unset choices on Accelerate's side (layer names taken from the model,
    a shard size of "the whole world" or "auto") agree with whatever the model has."""
    out = {}
    for field in dataclasses.fields(FSDP2Config):
        name = field.name
        if name in _PLANNING or name in _AT_SAVE or (name in _REDUCER_ONLY and not on_reducer):
            continue
        a, b = getattr(have, name), getattr(wanted, name)
        if name == "layer_cls_names" and (a is None or b is None or set(a) == set(b)):
            continue
        if name == "shard_size" and b in (None, "auto"):
            continue
        if name in UNSET_AGREES_AT_PREPARE and b == field.default:  # no Accelerate setting: unset agrees with any
            continue
        if a != b:
            out[name] = (a, b)
    return out


@contextlib.contextmanager
def prepared_as_it_is(model: nn.Module, wanted: FSDP2Config, plugin,
                      record: ShardedModel | None = None) -> Iterator[None]:
    """Around Accelerate's `_prepare_fsdp2` for a model hf_fsdp2 sharded before: its settings checked against
    `wanted` (what config_from_accelerator derives) and the plugin's activation checkpointing, which
    Accelerate applies itself before sharding (`fsdp2_apply_ac`) and which a sharded model has or lacks
    already: it is compared with the model's `activation_checkpointing` and switched off for the call. `record`:
    the model's, as prepare looked it up."""
    ac = bool(plugin.activation_checkpointing)
    if getattr(plugin, "activation_checkpointing_offload", False):
        raise ValueError("prepare: `fsdp_activation_checkpointing_offload` cannot apply to a model sharded before "
                         "prepare (hf_fsdp2.from_pretrained); use FSDP2Config(activation_offload=True) when loading it, "
                         "or let prepare shard the model.")
    keep_presharded(model, wanted.replace(activation_checkpointing=ac), record)
    plugin.activation_checkpointing = False
    try:
        yield
    finally:
        plugin.activation_checkpointing = ac


def keep_presharded(model: nn.Module, wanted: FSDP2Config, record: ShardedModel | None = None) -> nn.Module:
    """`model` as it is, once Accelerate's settings agree with its own (else a ValueError naming each), its
    mesh first (the engine checks the dimensions Accelerate's settings ask of it). `record`: the model's (None:
    looked up here)."""
    record = record if record is not None else record_of(model)
    have = record.config
    engine.refuse_another_mesh(record, wanted)
    differing = differing_settings(have, wanted, on_reducer=replication.is_replicated(model))
    if differing:
        given = ", ".join(f"{k}={v[1]!r}" for k, v in differing.items())
        raise ValueError(
            "prepare: the model was sharded before prepare (hf_fsdp2.from_pretrained) and cannot change how; the "
            "Accelerate settings (config file, Trainer arguments) ask for "
            + "; ".join(f"`{k}`={b!r} where the model has {a!r}" for k, (a, b) in differing.items())
            + f". Load it with hf_fsdp2.from_pretrained(..., hf_fsdp2.FSDP2Config({given})), or change the "
            "Accelerate settings to match.")
    if wanted.async_save != have.async_save:
        engine.keep_async_save(record, wanted.async_save)
        if collectives.rank() == 0:
            logging.getLogger("hf_fsdp2").info("prepare: async_save=%s from the Accelerate settings.", wanted.async_save)
    return model
