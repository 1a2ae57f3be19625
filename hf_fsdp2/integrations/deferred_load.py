"""Per-rank loading in Accelerate's `prepare` path: the model a script loads with transformers'
`from_pretrained` is built on the meta device on every rank, and `prepare` shards it and then reads each
rank's rows from the checkpoint, as `hf_fsdp2.from_pretrained` does. No rank holds the unsharded weights.

Why: with `fsdp_cpu_ram_efficient_loading` transformers (5.x, `modeling_utils`) still reads the whole
checkpoint on every rank (only keys the checkpoint lacks stay on meta off rank 0), and prepare then
shards from rank 0's copy (checkpoint/loading.py): every rank's RSS holds the whole model once,
which breaks a memory budget the auto layout planned for.

When: hf_fsdp2's backend is registered with `shard_size="auto"`, Accelerate runs FSDP2 with
`fsdp_cpu_ram_efficient_loading`, the process group is up with more than one rank, and the call is
`from_pretrained(<local directory of safetensors>, [dtype=..., config=...])` (an Auto class adds the config and
hub-only arguments) whose checkpoint holds every weight of
the model in the shapes it builds. Anything else (other keyword arguments, a hub id, .bin files, keys
missing from the checkpoint) loads as transformers does, said on rank 0 with the reason. What may happen
between the load and `prepare` is what transformers' ram-efficient loading already allows on the meta
ranks: PEFT's `get_peft_model` (adapters initialised at prepare by PEFT, rank 0's broadcast), values given with
`load_state_dict` (a saved adapter loaded with `PeftModel.from_pretrained` / `AutoPeftModelForCausalLM`, its
`modules_to_save` too, or other weights: kept at the load, `_keep_loaded_values`) or as real tensors (kept at
prepare, `keep_changes`), written over the directory's rows at prepare; gradient checkpointing, config changes.
An in-place change of a weight on meta is lost there: refused by name at prepare. Anything that needs the
weights' values (resizing embeddings, generate) does not work before `prepare`.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import weakref
from pathlib import Path

import torch
import torch.nn as nn

from ..checkpoint.errors import CheckpointError
from ..checkpoint.pretrained import build_on_meta, check_pretrained
from ..config import parse_dtype
from ..runtime import collectives, upstream
from ..sharding import ShardedModel, record_of
from ..sharding.model_parts import ModelParts, model_parts

SEAM = "transformers.modeling_utils.PreTrainedModel.from_pretrained"
_RESIZE_SEAM = "transformers.modeling_utils.PreTrainedModel.resize_token_embeddings"
_SAVE_SEAM = "transformers.modeling_utils.PreTrainedModel.save_pretrained"
_DTYPE_KWARGS = ("dtype", "torch_dtype")
# What the Auto classes pass along that only locates files on the hub: nothing to do for a local directory.
_HUB_ONLY = ("revision", "trust_remote_code", "cache_dir", "force_download", "local_files_only", "token", "proxies",
             "_commit_hash")
_LOG = logging.getLogger("hf_fsdp2")


def ram_efficient_fsdp2() -> bool:
    """Accelerate's environment for FSDP2 with `fsdp_cpu_ram_efficient_loading` in a process group of > 1 rank:
    transformers' own test for its ram-efficient loading (`is_fsdp_enabled`: the process group is up and
    Accelerate set ACCELERATE_USE_FSDP and FSDP_CPU_RAM_EFFICIENT_LOADING), with FSDP_VERSION=2."""
    from transformers.integrations import is_fsdp_enabled

    return (is_fsdp_enabled() and os.environ.get("FSDP_VERSION", "1").strip() == "2"
            and torch.distributed.get_world_size() > 1)


def load_on_meta(model_class, path, args: tuple, kwargs: dict) -> nn.Module | None:
    """The model built on meta with its checkpoint recorded for `prepare`, or None (said on rank 0) when this
    call cannot be deferred."""
    model, why = _try_meta(model_class, path, args, kwargs)
    if model is None:
        if collectives.rank() == 0:
            _LOG.warning("hf_fsdp2: %s.from_pretrained(%r) loads the whole checkpoint on every rank (transformers' "
                         "loading): %s.", getattr(model_class, "__name__", model_class), str(path), why)
        return None
    record = record_of(model, create=True)
    record.deferred_checkpoint = Path(path)
    record.deferred_versions = {id(t): (name, t, t._version) for name, t in _state_tensors(model).items()}
    loaded: list = []  # (name, tensor) the load in progress gives values to
    model.register_load_state_dict_pre_hook(functools.partial(_keep_loaded_values, loaded))
    model.register_load_state_dict_post_hook(functools.partial(_note_loaded_versions, loaded))
    model.register_forward_pre_hook(functools.partial(_not_before_prepare, id(model)))
    # PEFT's LoraModel calls `model.forward(...)` itself (its hooks never run): the input embedding's own
    # call is where every forward of the model passes.
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if isinstance(embedding, nn.Module):
        embedding.register_forward_pre_hook(functools.partial(_inner_not_before_prepare, id(embedding),
                                                              weakref.ref(model)))
    upstream.wrap_instance_method(model, "resize_token_embeddings", _RESIZE_SEAM,
                                  lambda original: _refuse_while_deferred(model, original, "resizing needs the "
                                                                          "embeddings' values"))
    upstream.wrap_instance_method(model, "save_pretrained", _SAVE_SEAM,
                                  lambda original: _refuse_while_deferred(model, original, "a save would write its "
                                                                          "config without weights"))
    if collectives.rank() == 0:
        _LOG.warning("hf_fsdp2: %s.from_pretrained(%r) is built on the meta device on every rank; accelerator.prepare "
                     "reads each rank's rows after sharding (shard_size='auto' with fsdp_cpu_ram_efficient_loading). "
                     "Prepare it before using its weights.", getattr(model_class, "__name__", model_class), str(path))
    return model


def _not_before_prepare(model_id: int, module: nn.Module, args) -> None:
    """A forward before prepare would compute on meta tensors and "succeed" with meta logits. (The layout
    planner traces a meta copy of the model, which carries this hook: copies pass.)"""
    if id(module) == model_id and record_of(module).deferred_checkpoint is not None:
        raise RuntimeError(_not_loaded_yet(type(module).__name__))


def _not_loaded_yet(what: str, why: str | None = None) -> str:
    """The one message for a use of a deferred model's weights before prepare loaded them."""
    return (f"{what}: its weights are not loaded yet: hf_fsdp2 deferred loading them to accelerator.prepare "
            "(shard_size='auto' with fsdp_cpu_ram_efficient_loading builds the model on the meta device)"
            + (f", and {why}" if why else "") + ". Pass it to accelerator.prepare first, or load it without "
            "ram-efficient loading.")


def _refuse_while_deferred(model: nn.Module, original, why: str):
    """A call that needs the weights' values before prepare loaded them: `resize_token_embeddings` (transformers'
    resize reads them: "Tensor.item() cannot be called on meta tensors", or a shape mismatch at prepare),
    `save_pretrained` (a config.json and no weights on the ranks whose tensors are meta). Refused by name;
    after prepare (weights loaded) it is transformers' own."""
    @functools.wraps(original)
    def refused(*args, **kwargs):
        if record_of(model).deferred_checkpoint is not None:
            raise RuntimeError(_not_loaded_yet(f"{type(model).__name__}.{original.__name__}", why))
        return original(*args, **kwargs)
    return refused


def _inner_not_before_prepare(embedding_id: int, model_ref, module: nn.Module, args) -> None:
    model = model_ref()
    if id(module) == embedding_id and model is not None:
        _not_before_prepare(id(model), model, args)


def _state_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors `load_state_dict` fills, by the names it matches (tied weights under each of their names)."""
    return model.state_dict(keep_vars=True)


def _keep_loaded_values(loaded: list, module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    """Values loaded into the deferred model before prepare (`model.load_state_dict(weights)`, PEFT's
    `PeftModel.from_pretrained` / `load_adapter` / AutoPeftModelForCausalLM: adapters and `modules_to_save`), kept
    for prepare: torch's copy into a meta tensor is a no-op, and prepare would read the directory's values or
    initialise adapters afresh (the load silently undone). A `load_state_dict` pre-hook (torch's public API on this
    one model) sees the keys torch will match; a copy, as torch's load copies, taken for those only (unexpected
    keys and shape mismatches are torch's to ignore or raise), by tensor: PEFT renames what it wraps."""
    record = record_of(module)
    loaded.clear()
    if record is None or record.deferred_checkpoint is None:  # prepared: a load is torch's own
        return
    targets = _state_tensors(module)
    for key, value in state_dict.items():
        name = key[len(prefix):]
        target = targets.get(name)
        if key.startswith(prefix) and isinstance(value, torch.Tensor) and target is not None \
                and tuple(value.shape) == tuple(target.shape):
            record.deferred_loaded[id(target)] = (target, value.detach().to("cpu", copy=True), name)
            loaded.append((name, target))


def _note_loaded_versions(loaded: list, module: nn.Module, incompatible_keys) -> None:
    """After a load: the loaded tensors' values are known again (kept), at their current version counter (torch's
    copy into them counted one change)."""
    record = record_of(module)
    if record is not None and record.deferred_checkpoint is not None:
        for name, target in loaded:
            record.deferred_versions[id(target)] = (name, target, target._version)
    loaded.clear()


# PEFT's wrapping in a name: `q_proj.base_layer.weight`, `lm_head.original_module.weight`,
# `lm_head.modules_to_save.default.weight` are all `q_proj.weight` / `lm_head.weight` of the model as loaded.
_PEFT_WRAPPING = re.compile(r"(\.(base_layer|original_module|modules_to_save\.[^.]+))+\.")


def keep_changes(model: nn.Module | ModelParts, record: ShardedModel | None = None) -> dict[str, torch.Tensor]:
    """At prepare, before the sharding (Accelerate's prepare, and TRL's reference models through it): what was
    changed since the load survives it or is refused by name. Returns the values given to it, by the names its
    tensors have now (for the fill, checkpoint/loading.py's `Deferred.values`, written over the directory's rows):
    a parameter given real
    values (`load_state_dict(..., assign=True)`, a new `nn.Parameter`) as it is; a tensor loaded into on meta, the
    values kept at the load; a `modules_to_save` copy PEFT made of a layer after weights were loaded into it, those
    (PEFT deep-copies the layer: one process's copy holds the loaded values). A tensor still on meta whose version
    counter moved since its values were last known (an in-place edit: `weight.zero_()`, an `nn.init` call, a
    module's `reset_parameters`) lost that change on meta: refused by name. (A change in place through `.data` has
    a version counter of its own: torch cannot tell it from no change.) `model`: a model, or the parts Accelerate's
    prepare made, with `record` its record."""
    parts = model if isinstance(model, ModelParts) else model_parts(model)
    record = record if record is not None else record_of(parts)
    changed = sorted({name for name, tensor, version in record.deferred_versions.values()
                      if tensor.is_meta and tensor._version != version})
    if changed:
        raise RuntimeError(
            f"{', '.join(changed[:5])}{' ...' if len(changed) > 5 else ''}: changed in place before "
            "accelerator.prepare, while hf_fsdp2 deferred loading the weights to prepare (shard_size='auto' with "
            "fsdp_cpu_ram_efficient_loading builds the model on the meta device, where an in-place change is lost). "
            "Make the change after prepare, give the values with model.load_state_dict(...) (kept for prepare), or "
            "load the model without ram-efficient loading.")
    values, copied_from = {}, {}
    state = _state_tensors(parts.base)
    for name, tensor in state.items():
        kept = record.deferred_loaded.get(id(tensor))
        if isinstance(tensor, nn.Parameter) and not tensor.is_meta:  # the sharding replaces it: this reference
            values[name] = tensor.detach()  # keeps its values until the fill
        elif kept is not None and kept[0] is tensor:
            values[name] = kept[1]
            if kept[2] == _PEFT_WRAPPING.sub(".", kept[2]):  # loaded before PEFT wrapped its layer
                copied_from[_PEFT_WRAPPING.sub(".", name)] = kept[1]
    for name in state:
        if name not in values and ".modules_to_save." in name and _PEFT_WRAPPING.sub(".", name) in copied_from:
            values[name] = copied_from[_PEFT_WRAPPING.sub(".", name)]
    record.deferred_loaded, record.deferred_versions = {}, {}
    return values


def filled(model: nn.Module | ShardedModel) -> None:
    """The deferred checkpoint was read into the prepared model (checkpoint/loading.py's `Deferred` fill): loads and
    forwards from now on are torch's own. `model`: the model, or its record (Accelerate's prepare holds it)."""
    record: ShardedModel = model if isinstance(model, ShardedModel) else record_of(model)
    record.deferred_checkpoint = None


def _try_meta(model_class, path, args: tuple, kwargs: dict) -> tuple[nn.Module | None, str]:
    if args:
        return None, "positional arguments after the path"
    other = sorted(k for k, v in kwargs.items() if k not in (*_DTYPE_KWARGS, "config", *_HUB_ONLY)
                   and not (k == "adapter_kwargs" and set(v or {}) <= {"revision", "token"}))  # no adapter dir
    if other:
        return None, f"keyword arguments other than dtype and config ({', '.join(other)})"
    config = kwargs.get("config")
    if config is not None and not hasattr(config, "to_dict"):
        return None, "`config` is not a config object"
    if getattr(config, "quantization_config", None) is not None:
        return None, "a quantization_config"
    directory = Path(os.fspath(path)) if isinstance(path, (str, os.PathLike)) else None
    if directory is None or not directory.is_dir():
        return None, "not a local directory"
    if not any((directory / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json")):
        return None, "no model.safetensors (or its index) in it"
    dtype = next((kwargs[k] for k in _DTYPE_KWARGS if kwargs.get(k) is not None), "auto")
    if dtype == "auto":  # transformers' default: the dtype the config records
        from transformers import AutoConfig

        config = config if config is not None else AutoConfig.from_pretrained(str(directory))  # read once
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if dtype is None:
            return None, "dtype 'auto' and the config records none"
    model = build_on_meta(model_class, directory, parse_dtype(dtype, "dtype"), config=config)
    try:  # every weight there, in the shapes built: the same check prepare's load makes, before deferring
        check_pretrained(model, directory)
    except CheckpointError as error:
        return None, str(error).splitlines()[1].strip() if "\n" in str(error) else str(error)
    if (directory / "generation_config.json").exists() and hasattr(model, "generation_config"):
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(str(directory))
    return model.eval(), ""  # from_pretrained returns the model in eval mode


def optimizer_parameter_names(args: tuple, model: nn.Module) -> list[list[list[str]]]:
    """For each optimizer in `args`, each param group's parameter names in `model` (taken before `prepare`)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [[[names[id(p)] for p in group["params"]] for group in opt.param_groups]
            for opt in args if isinstance(opt, torch.optim.Optimizer)]


def repoint_optimizers(result: tuple, names: list[list[list[str]]]) -> None:
    """Accelerate's `_prepare_fsdp2` maps each optimizer parameter to the prepared model's by `data_ptr()`,
    which is 0 for every meta parameter: all would map to one. Map them by name instead (Accelerate's own
    name canonicalisation, `fsdp2_canonicalize_names`, which drops wrapper prefixes)."""
    from accelerate.utils.fsdp_utils import fsdp2_canonicalize_names

    model = next(r for r in result if isinstance(r, nn.Module))
    prepared = fsdp2_canonicalize_names(dict(model.named_parameters()))
    optimizers = [r for r in result if isinstance(r, torch.optim.Optimizer)]
    for opt, groups in zip(optimizers, names):
        opt = getattr(opt, "optimizer", opt)  # AcceleratedOptimizer
        for group, group_names in zip(opt.param_groups, groups):
            canonical = fsdp2_canonicalize_names(dict.fromkeys(group_names))
            group["params"] = [prepared[n] for n in canonical]


__all__ = ["SEAM", "filled", "keep_changes", "load_on_meta", "optimizer_parameter_names",
           "ram_efficient_fsdp2", "repoint_optimizers"]
