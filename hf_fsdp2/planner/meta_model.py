"""The model on the meta device: from a config, a config.json, a model directory or a meta copy of
a module, with peft LoRA added; what memory.py costs and layout.py plans on."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn as nn

from ..config import parse_dtype
from ..runtime import user_files
from ..sharding.model_parts import ModelParts


DEFAULT_LORA_TARGETS = ("q_proj", "v_proj")

def load_hf_config(path: str | Path):
    """A transformers config from a model directory or a config.json file (local paths only)."""
    from transformers import AutoConfig

    p = Path(path)
    if not p.exists():
        raise ValueError(f"`model`={str(path)!r}: no such file or directory; pass a model directory or "
                         f"its config.json.")
    try:
        if p.is_dir():
            if not (p / "config.json").is_file():
                raise ValueError(f"`model`={str(path)!r} is a directory without a config.json.")
            # transformers reads it with plain json, unbounded (a RecursionError on deep nesting): read it bounded first
            user_files.load_json(p / "config.json", "a Hugging Face config.json")
            return AutoConfig.from_pretrained(str(p))
        values = user_files.load_json(p, "a Hugging Face config.json")  # bounded: size, nesting, UTF-8
        if not isinstance(values, dict) or "model_type" not in values:
            raise ValueError(f"`model`={str(path)!r} has no `model_type`; is it a Hugging Face config.json?")
        values = dict(values)
        return AutoConfig.for_model(values.pop("model_type"), **values)
    except user_files.UserFileError as e:
        raise ValueError(f"`model`={str(path)!r}: {e}") from None
    except (KeyError, OSError, TypeError, ValueError, *_strict_dataclass_errors()) as e:
        # unknown model_type, unreadable file, a field of the wrong type, transformers' own validation
        # (huggingface_hub's strict dataclasses: "hidden size is not a multiple of the number of heads")
        message = " ".join(str(e).split())
        raise ValueError(f"`model`={str(path)!r}: not a config transformers accepts: {message}") from None


def _strict_dataclass_errors() -> tuple[type, ...]:
    try:  # transformers >= 5 validates configs with huggingface_hub's strict dataclasses (not ValueErrors)
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:
        return ()
    return (StrictDataclassError,)


# Sizes a config must give as positive integers before a model is built from it (on meta, nothing is allocated,
# but a negative size fails deep in torch), and a bound on the layers built: one module per layer, and real models
# have at most a few hundred (a 100,000-layer config.json ran past two minutes).
_POSITIVE_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "head_dim")
MAX_LAYERS = 1024


def check_sizes(config) -> None:
    """A clear error, naming the field, for a config the meta model cannot be built from."""
    for name in _POSITIVE_SIZES:
        value = getattr(config, name, None)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"config `{name}`={value!r} must be a positive integer.")
    layers = getattr(config, "num_hidden_layers", None)
    if isinstance(layers, int) and layers > MAX_LAYERS:
        raise ValueError(f"config `num_hidden_layers`={layers}: more than {MAX_LAYERS} decoder layers is not estimated "
                         "here (the meta model builds one module per layer).")


def meta_copy(module: nn.Module) -> nn.Module:
    """A deep copy of `module` whose parameters and buffers live on the meta device (no data copied);
    tied parameters stay tied. A forward set on an instance (a wrapper such as TRL's fused-loss forward,
    `trl/trainer/utils.py`) closes over the original module's bound forward, which the copy would call with
    meta tensors: the copy runs its class's own forward instead (for the labels-and-loss call the planner
    traces, TRL's wrapper calls exactly that)."""
    return _meta_copied(module, module)


def meta_parts(parts: ModelParts, *, dtype: torch.dtype | str | None = None) -> ModelParts:
    """`build_meta_model` for the parts an entry made (hf_fsdp2/shard.py's plan): the model and the transformers
    model under it copied to meta in one copy, so the copy's parts are the copies of the parts (nothing is
    unwrapped again)."""
    dtype = parse_dtype(dtype, "dtype")
    _refuse_sharded(parts.model)
    copied = _meta_copied(parts.model, parts)
    if dtype is not None:
        copied.model.to(dtype)
    return copied


def _meta_copied(module: nn.Module, what):
    """`what` (the module, or an object holding it) deep-copied with `module`'s tensors on meta."""
    memo: dict[int, Any] = {}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    copied = copy.deepcopy(what, memo)
    for m in (copied if isinstance(copied, nn.Module) else copied.model).modules():
        if "forward" in vars(m):
            del m.forward
    return copied


def _refuse_sharded(module: nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule

    if isinstance(module, FSDPModule) or any(isinstance(m, FSDPModule) for m in module.modules()):
        raise ValueError("`model` is already sharded; estimate from its config or the unsharded model.")


def build_meta_model(source: Any, *, dtype: torch.dtype | str | None = None) -> nn.Module:
    """The causal LM `source` describes, on the meta device.

    `source`: a transformers config, a model directory or config.json path, or an `nn.Module` (copied
    to meta; the original is untouched). `dtype`: the parameters' storage dtype; None keeps a module's
    dtypes and uses fp32 for a config (fp32 master weights, as mixed-precision training keeps them).
    """
    dtype = parse_dtype(dtype, "dtype")
    if isinstance(source, nn.Module):
        _refuse_sharded(source)
        model = meta_copy(source)
        if dtype is not None:
            model.to(dtype)
        return model
    if isinstance(source, (str, Path)):
        source = load_hf_config(source)
    from transformers import AutoModelForCausalLM, PretrainedConfig

    if not isinstance(source, PretrainedConfig):
        raise TypeError(f"`model` must be a transformers config, a path or an nn.Module, got {type(source).__name__}.")
    check_sizes(source)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(source, dtype=dtype or torch.float32)
    except ValueError as e:  # a config with no causal-LM class
        raise ValueError(f"`model`: {type(source).__name__} has no causal LM class in transformers: {e}") from None
    except (RuntimeError, TypeError, *_strict_dataclass_errors()) as e:  # sizes transformers' modules cannot take
        message = " ".join(str(e).split())
        raise ValueError(f"`model`: transformers cannot build {type(source).__name__}'s model from this config: "
                         f"{message}") from None
    return model


def add_lora(model: nn.Module, r: int, targets: Sequence[str] = DEFAULT_LORA_TARGETS) -> nn.Module:
    """`get_peft_model` with LoRA rank `r` on `targets`, on the meta device: base weights frozen."""
    from peft import LoraConfig, get_peft_model

    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"`lora_r`={r!r} must be a positive integer.")
    targets = [t.strip() for t in targets if t and t.strip()]
    if not targets:
        raise ValueError("`lora_targets` is empty; name the modules to adapt, e.g. q_proj,v_proj.")
    try:
        # peft calls transformers' deprecated `is_gradient_checkpointing`: noise for an estimate's user
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets))
    except ValueError as e:
        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ValueError(f"`lora_targets`={targets}: {e} Linear modules in this model: {', '.join(names)}.") from None
