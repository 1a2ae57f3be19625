"""FSDP1 Accelerate configs, as projects publish them (PEFT's examples/sft/configs/fsdp_config*.yaml
have no `fsdp_version`), run as FSDP2 once `register()` is called.

The mapping is Accelerate's own, from `accelerate to-fsdp2` (accelerate/commands/to_fsdp2.py:
ARGUMENT_KEY_MAPPING, ARGUMENT_VALUE_MAPPING): `fsdp_sharding_strategy` becomes
`fsdp_reshard_after_forward` (FULL_SHARD -> true, SHARD_GRAD_OP -> false), FSDP1-only keys are
dropped, the rest keeps its name. Unlike that command we refuse the strategies FSDP2 would run
differently from what they say (HYBRID_SHARD*, NO_SHARD) instead of mapping them to plain sharding.
Used by the backend (the FSDP_* variables `accelerate launch` sets, before Accelerate builds its
plugin) and by `check-config` (the yaml), so both read a file the same way.
"""

from __future__ import annotations

import os
from typing import Any, MutableMapping

REFUSED_STRATEGIES = {
    "HYBRID_SHARD": "set `parallelism_config: {parallelism_config_dp_replicate_size: <nodes>, "
                    "parallelism_config_dp_shard_size: <ranks per node>}` and `fsdp_version: 2` for HSDP",
    "HYBRID_SHARD_ZERO2": "set `parallelism_config` with dp_replicate_size/dp_shard_size, `fsdp_version: 2` and "
                          "`fsdp_reshard_after_forward: false`",
    "NO_SHARD": "for replicas without sharding use DDP (no fsdp_config), or hf_fsdp2's HF_FSDP2_SHARD_SIZE=1",
}
# Keys whose value is worth a word when dropped (the launcher always sets the others' defaults).
_DROPPED_NOTE = {
    "fsdp_backward_prefetch": lambda v: v not in (None, "", "None", "NO_PREFETCH")
    and "FSDP2 prefetches the next group itself (hf_fsdp2's backward_prefetch sets the depth)",
    "fsdp_forward_prefetch": lambda v: str(v).lower() == "true"
    and "not implemented for FSDP2 by Accelerate; use hf_fsdp2's forward_prefetch (register() or HF_FSDP2_FORWARD_PREFETCH)",
}


def is_fsdp1(version: Any) -> bool:
    """Accelerate's reading: a missing `fsdp_version` is 1."""
    return version is None or str(version).strip() in ("", "1")


def convert_fsdp_config(section: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """An FSDP1 `fsdp_config` mapping -> (its FSDP2 form, one note per changed setting). Raises
    ValueError naming `fsdp_sharding_strategy` for a strategy FSDP2 cannot honour as written."""
    from accelerate.commands.to_fsdp2 import ARGUMENT_KEY_MAPPING, ARGUMENT_VALUE_MAPPING, ConversionStatus

    out: dict[str, Any] = {}
    notes = []
    for key, value in section.items():
        target = ARGUMENT_KEY_MAPPING.get(key)
        if key in ("fsdp_version", "fsdp_sharding_strategy"):
            continue
        if target is None:
            out[key] = value
        elif isinstance(target, ConversionStatus):
            note = _DROPPED_NOTE.get(key, lambda v: False)(value)
            if note:
                notes.append(f"{key}: {value!r} dropped ({note})")
        else:
            out[target] = ARGUMENT_VALUE_MAPPING.get(key, {}).get(_strategy(value), value)
    if "fsdp_sharding_strategy" in section:  # FSDP1 reads the strategy before reshard_after_forward
        value = section["fsdp_sharding_strategy"]
        strategy = _strategy(value)
        if strategy in REFUSED_STRATEGIES:
            raise ValueError(f"fsdp_config.fsdp_sharding_strategy: {value!r} has no FSDP2 equivalent that "
                             f"hf_fsdp2 runs as written; {REFUSED_STRATEGIES[strategy]}.")
        if strategy not in ARGUMENT_VALUE_MAPPING["fsdp_sharding_strategy"]:
            raise ValueError(f"fsdp_config.fsdp_sharding_strategy: {value!r} is not one of "
                             f"{', '.join(ARGUMENT_VALUE_MAPPING['fsdp_sharding_strategy'])}.")
        mapped = ARGUMENT_VALUE_MAPPING["fsdp_sharding_strategy"][strategy]
        out["fsdp_reshard_after_forward"] = mapped
        notes.append(f"fsdp_sharding_strategy: {strategy} -> fsdp_reshard_after_forward: {str(mapped).lower()}")
    out["fsdp_version"] = 2
    return out, notes


def _strategy(value: Any) -> Any:
    """'full_shard' / '1' (Accelerate's 1-based index) -> 'FULL_SHARD'; other values unchanged."""
    from accelerate.utils.constants import FSDP_SHARDING_STRATEGY

    text = str(value).strip().upper()
    if text.isdigit() and 1 <= int(text) <= len(FSDP_SHARDING_STRATEGY):
        return FSDP_SHARDING_STRATEGY[int(text) - 1]
    return text if text in FSDP_SHARDING_STRATEGY else value


# `accelerate launch` passes each yaml key on as an FSDP_* variable (accelerate/utils/launch.py
# prepare_multi_gpu_env); these two are not simply upper-cased.
_ENV_NAMES = {"fsdp_transformer_layer_cls_to_wrap": "FSDP_TRANSFORMER_CLS_TO_WRAP",
              "fsdp_offload_params": "FSDP_OFFLOAD_PARAMS"}


def _env_name(key: str) -> str:
    return _ENV_NAMES.get(key, key.upper())


def convert_environment(environ: MutableMapping[str, str] | None = None) -> list[str]:
    """Under `accelerate launch` with an FSDP1 config (FSDP_VERSION 1 or unset), rewrite the FSDP_*
    variables to the FSDP2 config `convert_fsdp_config` gives; returns its notes ([] when nothing to do)."""
    from accelerate.commands.to_fsdp2 import ARGUMENT_KEY_MAPPING

    environ = os.environ if environ is None else environ
    if environ.get("ACCELERATE_USE_FSDP", "").lower() != "true" or not is_fsdp1(environ.get("FSDP_VERSION")):
        return []
    section = {key: environ[_env_name(key)] for key in ARGUMENT_KEY_MAPPING if _env_name(key) in environ}
    converted, notes = convert_fsdp_config(section)
    for key in section:
        environ.pop(_env_name(key))
    for key, value in converted.items():
        environ[_env_name(key)] = str(value).lower() if isinstance(value, bool) else str(value)
    return ["fsdp_version: 1 -> 2"] + notes
