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
ranks: PEFT's `get_peft_model` (adapters initialised at prepare by PEFT, rank 0's broadcast), a saved adapter
loaded with `PeftModel.from_pretrained` / `AutoPeftModelForCausalLM` (its values kept at the load, restored at
prepare: `_keep_adapter_values`), gradient
checkpointing, config changes; anything that needs the weights' values (resizing embeddings, generate)
does not work before `prepare`.
"""

from __future__ import annotations

import functools
import logging
import os
import weakref
from pathlib import Path

import torch
import torch.nn as nn

from ..checkpoint.errors import CheckpointError
from ..checkpoint.pretrained import build_on_meta, check_pretrained
from ..config import parse_dtype
from ..runtime import collectives, upstream
from ..sharding import record_of

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
    record_of(model, create=True).deferred_checkpoint = Path(path)
    model.register_load_state_dict_pre_hook(_keep_adapter_values)
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


def _keep_adapter_values(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    """Adapter values loaded into the model before prepare (PEFT's `PeftModel.from_pretrained` or
    `load_adapter` on it, AutoPeftModelForCausalLM: `load_state_dict` of the adapter's keys), kept for
    prepare: its adapters are on meta until then, where torch's copy is a no-op, and prepare would
    initialise them afresh (a trained adapter silently replaced). A `load_state_dict` pre-hook, torch's
    public API on this one model; the values are the adapter's, small."""
    kept = record_of(module).deferred_adapter_values
    for key, value in state_dict.items():
        if key.startswith(prefix) and ".lora_" in key and isinstance(value, torch.Tensor):
            kept[key[len(prefix):]] = value.detach().to("cpu", copy=True)


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


def deferred_checkpoint(model: nn.Module) -> Path | None:
    """The checkpoint `load_on_meta` deferred for `model` (or the PEFT model around it), not loaded yet."""
    record = record_of(model)
    return getattr(record, "deferred_checkpoint", None)


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


__all__ = ["SEAM", "deferred_checkpoint", "load_on_meta", "optimizer_parameter_names", "ram_efficient_fsdp2",
           "repoint_optimizers"]
