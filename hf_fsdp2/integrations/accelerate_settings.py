"""Accelerate's FSDP settings -> `FSDP2Config` fields, defined once.

The backend reads the settings from Accelerate's plugin and accelerator (integrations/accelerate.py:
`config_from_accelerator`), `check-config` from the yaml as the launcher passes it on
(tools/check_config.py: `fsdp2_values`); both then map them here, so the file check and the launched
run cannot disagree.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Mapping

from ..config import ACCELERATE_PARALLEL_SIZES, ACCELERATE_PRECISIONS, FSDP2Config

ENV_PREFIX = "HF_FSDP2_"


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
    # parallelism_config's other sizes, by config.ACCELERATE_PARALLEL_SIZES' names (FSDP2Config's settings of those names)
    parallel_sizes: Mapping[str, int] = dataclasses.field(default_factory=dict)


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
        "param_dtype": None,
    }
    values.update(ACCELERATE_PRECISIONS.get(precision, {}))  # what the precision stands for here (config.py)
    if str(settings.wrap_policy).lower() in ("size", "size_based_wrap"):
        values["min_num_params"] = settings.min_num_params or 0
    if settings.ignored_modules:
        values["ignored_modules"] = settings.ignored_modules
    sizes = {name: size for name, size in settings.parallel_sizes.items() if size > 1}
    if settings.replicate_size > 1:
        values["replicate_size"] = settings.replicate_size
        shard = settings.shard_size * math.prod(size for name, size in sizes.items() if ACCELERATE_PARALLEL_SIZES[name])
        values["shard_size"] = shard if shard > 1 else None
    values.update(sizes)  # each on the accelerator's mesh dimension of that technique (its module applies it there)
    return values
