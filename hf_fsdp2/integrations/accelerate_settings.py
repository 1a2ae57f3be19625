"""Accelerate's FSDP settings -> `FSDP2Config` fields, defined once.

The backend reads the settings from Accelerate's plugin and accelerator (integrations/accelerate.py:
`config_from_accelerator`), `check-config` from the yaml as the launcher passes it on
(tools/check_config.py: `fsdp2_values`); both then map them here, so the file check and the launched
run cannot disagree.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from ..config import FSDP2Config

ENV_PREFIX = "HF_FSDP2_"

# Compute dtype per Accelerate `mixed_precision`; gradients are reduced in fp32 whatever it is
# (Accelerate would reduce in bf16). fp8: the layers' linears in FP8 (torchao), the rest in bf16.
PARAM_DTYPES = {"bf16": "bf16", "fp16": "fp16", "fp8": "bf16"}


@dataclasses.dataclass(frozen=True)
class AccelerateSettings:
    wrap_policy: str  # as FSDP2Config takes it: transformer / size / none (or Accelerate's names)
    layer_names: Any = None  # transformer_cls_names_to_wrap: a list, a comma string, or the launcher's str(list)
    min_num_params: int = 0
    ignored_modules: str | None = None  # a regex of module names
    reshard_after_forward: bool | None = None
    cpu_offload: bool = False
    mixed_precision: str = "no"
    replicate_size: int = 1  # parallelism_config dp_replicate_size
    shard_size: int = 1  # parallelism_config dp_shard_size
    tp_size: int = 1  # parallelism_config tp_size
    cp_size: int = 1  # parallelism_config cp_size: FSDP2 shards over dp_shard x cp (sharding/context_parallel.py)


def env_overrides(environ: dict[str, str] | None = None) -> dict[str, Any]:
    """`HF_FSDP2_FROZEN_DTYPE=bf16` -> {"frozen_dtype": "bf16"}; unknown names raise, naming the variable.
    The settings Accelerate's yaml cannot carry (its launcher drops keys it does not know), e.g. `ep_size`."""
    environ = os.environ if environ is None else environ
    values = {k[len(ENV_PREFIX):].lower(): v for k, v in environ.items() if k.startswith(ENV_PREFIX)}
    FSDP2Config.from_dict(values, source=f"{ENV_PREFIX}* environment variables")  # validates names and values
    return values


def layer_names(raw: Any) -> list[str] | None:
    """Class names from the plugin: a comma string, a list, or the launcher's mangled `str(list)`."""
    if raw is None:
        return None
    items = raw.split(",") if isinstance(raw, str) else list(raw)
    names = [str(item).strip().strip("[]").strip().strip("'\"").strip() for item in items]
    return [n for n in names if n] or None


def fsdp2_values(settings: AccelerateSettings) -> dict[str, Any]:
    """The FSDP2Config fields these settings give (before register() overrides and HF_FSDP2_* variables)."""
    precision = str(settings.mixed_precision).lower()
    values: dict[str, Any] = {
        "wrap_policy": settings.wrap_policy,
        "layer_cls_names": layer_names(settings.layer_names),
        "reshard_after_forward": settings.reshard_after_forward,
        "cpu_offload": settings.cpu_offload,
        "activation_checkpointing": False,  # Accelerate applies its own (fsdp2_apply_ac) before hf_fsdp2 shards
        "param_dtype": PARAM_DTYPES.get(precision),
    }
    if precision == "fp8":
        values["fp8"] = True
    if str(settings.wrap_policy).lower() in ("size", "size_based_wrap"):
        values["min_num_params"] = settings.min_num_params or 0
    if settings.ignored_modules:
        values["ignored_modules"] = settings.ignored_modules
    if settings.replicate_size > 1:
        values["replicate_size"] = settings.replicate_size
        shard = settings.shard_size * settings.cp_size
        values["shard_size"] = shard if shard > 1 else None
    if settings.tp_size > 1:  # TP on the accelerator's "tp" mesh dimension (sharding/tensor_parallel.py)
        values["tp_size"] = settings.tp_size
    if settings.cp_size > 1:  # CP on the accelerator's "cp" mesh dimension (sharding/context_parallel.py)
        values["cp_size"] = settings.cp_size
    return values
