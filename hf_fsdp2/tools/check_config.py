"""`hf-fsdp2 check-config`: find what Accelerate would drop, mangle or reject in a config file, and
what hf_fsdp2 cannot honour, before anything is launched.

Accelerate's config file reaches the training processes by a lossy path, which this module
replays without importing Accelerate (pinned to the versions `integrations.accelerate` supports;
`tests/test_check_config.py` checks every table and claim here against the installed Accelerate):

1. `load_config_from_file` reads the yaml into `ClusterConfig`; an unknown top-level key is an error.
2. `commands/launch.py: _validate_launch_command` copies each `fsdp_config` entry onto the argparse
   namespace as `args.fsdp_<key>` (prefixing keys that do not start with "fsdp") and each
   `parallelism_config` entry as `args.<key>` (no prefix); an `args` attribute no argument defines
   is set and never read, so unknown keys vanish without a word. Keys the yaml omits keep the
   argparse defaults, which are strings ("true", "false", "1").
3. `utils/launch.py: prepare_multi_gpu_env` turns the namespace into `FSDP_*` / `PARALLELISM_CONFIG_*`
   environment variables, mostly as `str(value).lower()`; a yaml list becomes "['A', 'B']".
4. In each process `FullyShardedDataParallelPlugin` / `ParallelismConfig` parse those variables
   back (`str_to_bool`, `int`, enum lookups), and `config_from_accelerator` maps them to an
   `FSDP2Config`.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal, Mapping

from ..runtime import user_files
from ..config import ACCELERATE_PARALLEL_SIZES, FSDP2Config
from ..integrations import accelerate_settings

# ---------------------------------------------------------------------------------------------
# What Accelerate (>= 1.10, < 1.16) knows. Checked against the installed version by the tests.

# `ClusterConfig`'s fields, plus the two legacy keys `BaseConfig.process_config` converts (`fp16`,
# `dynamo_backend`). Any other top-level key makes `load_config_from_file` raise.
TOP_LEVEL_KEYS = frozenset({
    "command_file", "commands", "compute_environment", "debug", "deepspeed_config", "distributed_type",
    "downcast_bf16", "dynamo_config", "enable_cpu_affinity", "fp8_config", "fsdp_config", "gpu_ids",
    "machine_rank", "main_process_ip", "main_process_port", "main_training_function", "megatron_lm_config",
    "mixed_precision", "mpirun_config", "num_machines", "num_processes", "parallelism_config", "rdzv_backend",
    "same_network", "tpu_env", "tpu_name", "tpu_use_cluster", "tpu_use_sudo", "tpu_vm", "tpu_zone", "use_cpu",
    "fp16", "dynamo_backend",
})

# The launcher's `--fsdp_*` arguments, all read by `prepare_multi_gpu_env`, plus `fsdp_ignored_modules`,
# which it reads with `getattr` although no argument defines it.
FSDP_KEYS = frozenset({
    "fsdp_activation_checkpointing", "fsdp_activation_checkpointing_offload", "fsdp_auto_wrap_policy",
    "fsdp_backward_prefetch", "fsdp_cpu_ram_efficient_loading", "fsdp_forward_prefetch", "fsdp_min_num_params",
    "fsdp_offload_params", "fsdp_reshard_after_forward", "fsdp_sharding_strategy", "fsdp_state_dict_type",
    "fsdp_sync_module_states", "fsdp_transformer_layer_cls_to_wrap", "fsdp_use_orig_params", "fsdp_version",
    "fsdp_ignored_modules",
})

# The launcher's `--parallelism_config_*` arguments. yaml keys are used as written: no prefix is added.
PARALLELISM_KEYS = frozenset({
    "parallelism_config_cp_backend", "parallelism_config_cp_comm_strategy", "parallelism_config_cp_size",
    "parallelism_config_dp_replicate_size", "parallelism_config_dp_shard_size",
    "parallelism_config_sp_attn_implementation", "parallelism_config_sp_backend",
    "parallelism_config_sp_seq_length", "parallelism_config_sp_seq_length_is_variable",
    "parallelism_config_sp_size", "parallelism_config_tp_size",
})

# Defaults of the launcher arguments hf_fsdp2's checks depend on (strings, as argparse stores them).
_LAUNCHER_DEFAULTS = {
    "fsdp_version": "1",
    "fsdp_reshard_after_forward": "true",
    "fsdp_offload_params": "false",
    "fsdp_activation_checkpointing": "false",
    "fsdp_activation_checkpointing_offload": "false",
    "fsdp_cpu_ram_efficient_loading": "true",
    "fsdp_sync_module_states": "true",
    "fsdp_forward_prefetch": "false",
}

_DISTRIBUTED_TYPES = ("NO", "MULTI_CPU", "MULTI_GPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA",
                      "MULTI_XPU", "DEEPSPEED", "FSDP", "XLA", "MEGATRON_LM", "MULTI_HPU", "MULTI_NEURON")
_PRECISIONS = ("no", "fp8", "fp16", "bf16")  # accelerate.utils.PrecisionType
_AUTO_WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
_STATE_DICT_TYPES = ("FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT")  # StateDictType 1..3
_BACKWARD_PREFETCH = ("BACKWARD_PRE", "BACKWARD_POST")  # BackwardPrefetch 1..2; NO_PREFETCH means None
_SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
_TRUE = ("y", "yes", "t", "true", "on", "1")  # accelerate.utils.str_to_bool
_FALSE = ("n", "no", "f", "false", "off", "0")


# ---------------------------------------------------------------------------------------------
# Public API


@dataclass(frozen=True)
class Finding:
    """One problem: `error` means the file will not do what it says with hf_fsdp2; `warning` means it
    works, but not quite as written."""

    level: Literal["error", "warning"]
    key: str  # dotted path in the file, e.g. "fsdp_config.fsdp_version"
    message: str

    def __str__(self) -> str:
        return f"{self.level}: {self.key}: {self.message}"


class ConfigFileError(ValueError):
    """The file cannot be checked at all: missing, unreadable, not yaml/json, or not a mapping."""


def check_accelerate_config(path: str | Path, environ: Mapping[str, str] | None = None) -> list[Finding]:
    """Check an Accelerate config file (yaml, or json by extension, as Accelerate reads it) for use with
    hf_fsdp2, with the HF_FSDP2_* variables of `environ` (default: this process's environment, the launch's).
    Pure: reads the file, imports nothing from Accelerate, launches nothing.

    Raises `ConfigFileError` when the file cannot be read as a mapping.
    """
    return check_accelerate_config_dict(load_config_file(path), environ)


def load_config_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:  # bounded: size, nesting and YAML alias expansion (runtime/user_files.py)
        data = (user_files.load_json if path.suffix == ".json" else user_files.load_yaml)(path, "an Accelerate config")
    except user_files.UserFileError as e:
        raise ConfigFileError(str(e)) from None
    if not isinstance(data, dict):
        raise ConfigFileError(f"{path}: an Accelerate config must be a mapping of settings (as `accelerate config` "
                              f"writes), got {type(data).__name__}.")
    return data


def check_accelerate_config_dict(cfg: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> list[Finding]:
    """`check_accelerate_config` on an already-parsed file."""
    out: list[Finding] = []
    _check_top_level_keys(cfg, out)
    _check_launch(cfg, out)
    fsdp = _check_fsdp_config(cfg, out)
    parallel = _check_parallelism_config(cfg, out)
    if not any(f.level == "error" for f in out):
        _check_fsdp2_config(cfg, fsdp, parallel, out, environ)
    return out


# ---------------------------------------------------------------------------------------------
# Helpers


def _error(out: list[Finding], key: str, message: str) -> None:
    out.append(Finding("error", key, message))


def _warn(out: list[Finding], key: str, message: str) -> None:
    out.append(Finding("warning", key, message))


def _closest(key: str, valid: frozenset[str]) -> str | None:
    close = difflib.get_close_matches(key, sorted(valid), n=1)
    return close[0] if close else None


def _launcher_bool(value: Any) -> bool | None:
    """How `str_to_bool(str(value).lower())` reads a value in the training process; None: it raises."""
    text = str(value).lower()
    return True if text in _TRUE else False if text in _FALSE else None


def _int(value: Any) -> int | None:
    """How `int(str(value))` reads a value after the environment round trip; None: it raises."""
    if isinstance(value, bool):
        return None
    try:
        return int(str(value))
    except ValueError:
        return None


_FSDP2_FIELDS = {f.name for f in fields(FSDP2Config)}


# ---------------------------------------------------------------------------------------------
# Top level: keys, launch shape, precision


def _check_top_level_keys(cfg: Mapping[str, Any], out: list[Finding]) -> None:
    for key in cfg:
        if key in TOP_LEVEL_KEYS:
            continue
        name = str(key)
        if name in FSDP_KEYS or "fsdp_" + name in FSDP_KEYS:
            hint = "it belongs inside `fsdp_config`"
        elif name in PARALLELISM_KEYS or "parallelism_config_" + name in PARALLELISM_KEYS:
            hint = "it belongs inside `parallelism_config`"
        else:
            close = _closest(name, TOP_LEVEL_KEYS)
            hint = f"did you mean {close}?" if close else f"valid keys: {', '.join(sorted(TOP_LEVEL_KEYS))}"
        _error(out, name, f"Accelerate refuses unknown top-level keys (load_config_from_file raises); {hint}")


def _check_launch(cfg: Mapping[str, Any], out: list[Finding]) -> None:
    env = cfg.get("compute_environment", "LOCAL_MACHINE")
    if env != "LOCAL_MACHINE":
        _error(out, "compute_environment", f"{env!r}: hf_fsdp2 supports LOCAL_MACHINE only; Accelerate applies "
                                           "`fsdp_config` for LOCAL_MACHINE configs only.")

    if "distributed_type" not in cfg:
        _error(out, "distributed_type", "missing; Accelerate requires it, and hf_fsdp2 needs `distributed_type: FSDP`.")
    elif cfg["distributed_type"] != "FSDP":
        what = ("is not a distributed type" if cfg["distributed_type"] not in _DISTRIBUTED_TYPES
                else "does not turn FSDP on")
        _error(out, "distributed_type", f"{cfg['distributed_type']!r} {what}; hf_fsdp2 needs `distributed_type: FSDP` "
                                        "(also on CPU-only machines, where hf_fsdp2 runs FSDP over gloo itself).")

    if _launcher_bool(cfg.get("use_cpu", False)):
        _error(out, "use_cpu", "`use_cpu: true` does nothing with FSDP: Accelerate's FSDP launcher never reads it "
                               "(only the plain CPU launcher does, and `--cpu` on the command line would switch FSDP "
                               "off), so on a GPU machine training still runs on the GPUs. On a CPU-only machine "
                               "hf_fsdp2 engages FSDP over gloo by itself. Set `use_cpu: false`; to force CPU on a GPU "
                               "machine, hide the GPUs with CUDA_VISIBLE_DEVICES=\"\".")

    _check_mixed_precision(cfg, out)
    _check_process_counts(cfg, out)


def _check_mixed_precision(cfg: Mapping[str, Any], out: list[Finding]) -> None:
    if "mixed_precision" not in cfg:
        return  # Accelerate: "fp16" when the legacy `fp16: true` is set, else "no"
    value = cfg["mixed_precision"]
    if value is None:
        return
    if isinstance(value, bool):
        _error(out, "mixed_precision", f"yaml reads an unquoted {'yes/on/true' if value else 'no/off/false'} as the "
                                       f"boolean {str(value).lower()}, and Accelerate's launcher then crashes "
                                       f"(`'bool' object has no attribute 'lower'`); quote it: mixed_precision: 'no'.")
        return
    mp = str(value).lower()
    if mp == "fp8":
        # hf_fsdp2 runs FP8 through torchao only (FSDP2Config.fp8: FP8 all-gather); Accelerate picks AO
        # when no backend is named and torchao is installed (Accelerator.fp8_backend).
        backend = str((cfg.get("fp8_config") or {}).get("backend") or "").upper()
        if backend not in ("", "AO"):
            _error(out, "fp8_config.backend", f"{backend!r}: hf_fsdp2 runs FP8 through torchao only; "
                                              "use backend: AO.")
        else:
            try:
                import torchao.float8  # noqa: F401
            except ImportError:
                _error(out, "mixed_precision", "'fp8' needs torchao: pip install 'torchao>=0.17'.")
    elif mp not in _PRECISIONS:
        _error(out, "mixed_precision", f"{value!r} is not a precision; use 'no', 'bf16' or 'fp16'.")


def _check_process_counts(cfg: Mapping[str, Any], out: list[Finding]) -> None:
    machines = _int(cfg.get("num_machines", 1))
    if machines is None or machines < 1:
        _error(out, "num_machines", f"{cfg.get('num_machines')!r} must be an integer >= 1.")
        machines = None
    if "num_processes" not in cfg:
        _warn(out, "num_processes", "not set: `accelerate launch` then needs --num_processes on its command line.")
    else:
        procs = _int(cfg["num_processes"])
        if procs is None or procs < 1:
            _error(out, "num_processes", f"{cfg['num_processes']!r} must be an integer >= 1 (all processes, over all "
                                         "machines).")
        elif machines and machines > 1 and not isinstance(cfg["num_processes"], int):
            _error(out, "num_processes", f"{cfg['num_processes']!r} is quoted: with several machines the launcher "
                                         "computes num_processes // num_machines and crashes; write the integer.")
        elif machines and procs % machines:
            _error(out, "num_processes", f"{procs} processes do not split evenly over {machines} machines; the "
                                         f"launcher starts num_processes // num_machines = {procs // machines} per "
                                         "machine. `num_processes` counts all processes on all machines.")
    rank = cfg.get("machine_rank", 0)
    if _int(rank) is None or not 0 <= _int(rank) < (machines or 1 << 30):
        _error(out, "machine_rank", f"{rank!r} must be an integer in [0, num_machines).")
    if machines and machines > 1 and not cfg.get("main_process_ip"):
        _warn(out, "main_process_ip", f"not set for {machines} machines: pass --main_process_ip (machine 0's "
                                      "address) to `accelerate launch` on every machine.")


# ---------------------------------------------------------------------------------------------
# fsdp_config


@dataclass
class _Fsdp:
    """The `fsdp_config` entries as the launcher sees them: normalised name -> (yaml key, value)."""

    given: dict[str, tuple[str, Any]]

    def raw(self, name: str) -> Any:
        """The launcher's value: the yaml's, else the argparse default (None when it has none)."""
        return self.given[name][1] if name in self.given else _LAUNCHER_DEFAULTS.get(name)

    def key(self, name: str) -> str:
        return "fsdp_config." + (self.given[name][0] if name in self.given else name)

    def has(self, name: str) -> bool:
        return name in self.given and self.given[name][1] is not None


def _check_fsdp_config(cfg: Mapping[str, Any], out: list[Finding]) -> _Fsdp:
    section = cfg.get("fsdp_config")
    fsdp = _Fsdp({})
    if section is not None and not isinstance(section, dict):
        _error(out, "fsdp_config", f"must be a mapping of fsdp_* settings, got {type(section).__name__}; Accelerate "
                                   "ignores it whole.")
        section = None
    for key, value in (section or {}).items():
        if not isinstance(key, str):
            _error(out, f"fsdp_config.{key}", "keys must be strings; Accelerate's launcher crashes on this one.")
            continue
        name = key if key.startswith("fsdp") else "fsdp_" + key  # what _validate_launch_command does
        if name not in FSDP_KEYS:
            _error(out, f"fsdp_config.{key}", _unknown_fsdp_key_message(key, name))
            continue
        if name in fsdp.given:
            _warn(out, f"fsdp_config.{key}", f"also given as `{fsdp.given[name][0]}`; Accelerate keeps this later one.")
        fsdp.given[name] = (key, value)

    _convert_fsdp1(fsdp, out)
    _check_fsdp_version(fsdp, out)
    for name in ("fsdp_reshard_after_forward", "fsdp_offload_params", "fsdp_activation_checkpointing",
                 "fsdp_activation_checkpointing_offload", "fsdp_cpu_ram_efficient_loading"):
        _check_bool(fsdp, name, out)
    _check_wrapping(fsdp, out)
    _check_loading(fsdp, out)
    _check_ignored_by_fsdp2(fsdp, out)
    _check_state_dict_type(fsdp, out)
    if fsdp.has("fsdp_ignored_modules"):
        import re

        try:
            re.compile(str(fsdp.raw("fsdp_ignored_modules")))
        except re.error as e:
            _error(out, fsdp.key("fsdp_ignored_modules"), f"not a regular expression ({e}); Accelerate and "
                                                          "hf_fsdp2 match it against module names.")
    return fsdp


def _unknown_fsdp_key_message(key: str, name: str) -> str:
    message = "Accelerate drops unknown fsdp_config keys silently"
    field = name.removeprefix("fsdp_")
    if field in _FSDP2_FIELDS:
        return (f"{message}; `{field}` is an hf_fsdp2 setting the yaml cannot carry: pass it as "
                f"hf_fsdp2.register({field}=...) or the HF_FSDP2_{field.upper()} environment variable.")
    close = _closest(name, FSDP_KEYS)
    return f"{message}; did you mean {close}?" if close else f"{message}; valid keys: {', '.join(sorted(FSDP_KEYS))}."


def _convert_fsdp1(fsdp: _Fsdp, out: list[Finding]) -> None:
    """An FSDP1 section (no `fsdp_version`, or 1) is checked as the FSDP2 section the backend runs it as."""
    from ..integrations import fsdp1_configs

    if not fsdp.given or not fsdp1_configs.is_fsdp1(fsdp.given.get("fsdp_version", (None, None))[1]):
        return
    try:
        converted, notes = fsdp1_configs.convert_fsdp_config({name: value for name, (_, value) in fsdp.given.items()})
    except ValueError as e:
        _error(out, fsdp.key("fsdp_sharding_strategy"), str(e).split(": ", 1)[1])
        return
    _warn(out, fsdp.key("fsdp_version"), "an FSDP1 config: with hf_fsdp2.register() it runs as FSDP2, converted with "
                                         "Accelerate's own mapping (accelerate to-fsdp2): "
                                         + "; ".join(["fsdp_version: 1 -> 2"] + notes) + ".")
    fsdp.given = {name: (fsdp.given[name][0] if name in fsdp.given else name, value) for name, value in converted.items()}


def _check_fsdp_version(fsdp: _Fsdp, out: list[Finding]) -> None:
    key = fsdp.key("fsdp_version")
    if "fsdp_version" not in fsdp.given:
        _error(out, key, "missing: Accelerate then uses FSDP1; hf_fsdp2 needs `fsdp_version: 2`.")
    elif _int(fsdp.raw("fsdp_version")) != 2:
        _error(out, key, f"{fsdp.raw('fsdp_version')!r}: hf_fsdp2 needs `fsdp_version: 2` (Accelerate reads it with "
                         "int(), so write the integer 2).")


def _check_bool(fsdp: _Fsdp, name: str, out: list[Finding]) -> None:
    if name not in fsdp.given or _launcher_bool(fsdp.raw(name)) is not None:
        return
    value = fsdp.raw(name)
    message = (f"{value!r} is not a boolean: the launcher passes str(value).lower() on and Accelerate's str_to_bool "
               "raises in every process; use true or false.")
    if name == "fsdp_reshard_after_forward":
        if str(value).upper() in _SHARDING_STRATEGIES:
            message += " (FSDP1's strategies map to FSDP2 as FULL_SHARD -> true, SHARD_GRAD_OP -> false.)"
        elif _int(value) is not None:
            message += (f" To reshard to groups of {value} ranks, use hf_fsdp2.register(reshard_after_forward={value}) "
                        f"or HF_FSDP2_RESHARD_AFTER_FORWARD={value}: Accelerate's FSDP2 takes only a bool.")
    _error(out, fsdp.key(name), message)


def _check_wrapping(fsdp: _Fsdp, out: list[Finding]) -> None:
    policy = str(fsdp.raw("fsdp_auto_wrap_policy") or "NO_WRAP").upper()
    if policy not in _AUTO_WRAP_POLICIES:
        _error(out, fsdp.key("fsdp_auto_wrap_policy"), f"{fsdp.raw('fsdp_auto_wrap_policy')!r} is not one of "
                                                       f"{', '.join(_AUTO_WRAP_POLICIES)}; Accelerate raises.")
        return
    layers_key = fsdp.key("fsdp_transformer_layer_cls_to_wrap")
    if fsdp.has("fsdp_transformer_layer_cls_to_wrap"):
        value = fsdp.raw("fsdp_transformer_layer_cls_to_wrap")
        if policy != "TRANSFORMER_BASED_WRAP":
            _warn(out, layers_key, f"ignored: Accelerate reads the layer classes only with `fsdp_auto_wrap_policy: "
                                   f"TRANSFORMER_BASED_WRAP` (here {policy}); hf_fsdp2 honours {policy}"
                                   + (" (one fully_shard group for the whole model)" if policy == "NO_WRAP" else "")
                                   + ". Set TRANSFORMER_BASED_WRAP for one group per decoder layer.")
        elif isinstance(value, (list, tuple)):
            _warn(out, layers_key, f"a yaml list is mangled by Accelerate's launcher (str(list) into an environment "
                                   f"variable, split on commas: {str(value).split(',')}); hf_fsdp2 repairs it once "
                                   f"register() is called, Accelerate alone would look for those names and fail. "
                                   f"Write a comma-separated string: {','.join(str(v) for v in value)}")
    ac = _launcher_bool(fsdp.raw("fsdp_activation_checkpointing"))
    if ac and policy == "NO_WRAP":
        _error(out, fsdp.key("fsdp_activation_checkpointing"), "Accelerate applies activation checkpointing through "
                                                               "the auto wrap policy and crashes without one "
                                                               "(fsdp2_apply_ac calls None); set "
                                                               "`fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP`.")
    if _launcher_bool(fsdp.raw("fsdp_activation_checkpointing_offload")) and ac is False:
        _error(out, fsdp.key("fsdp_activation_checkpointing_offload"), "needs `fsdp_activation_checkpointing: true`; "
                                                                       "Accelerate raises.")


def _check_loading(fsdp: _Fsdp, out: list[Finding]) -> None:
    """`fsdp_cpu_ram_efficient_loading` works (rank 0 loads, hf_fsdp2 broadcasts its weights tensor by
    tensor while sharding: checkpoint/loading.py `FromRank0`), and the launcher turns it on
    when the yaml omits it. Only its pairing with `fsdp_sync_module_states` can stop the launcher."""
    ram, sync = fsdp.raw("fsdp_cpu_ram_efficient_loading"), fsdp.raw("fsdp_sync_module_states")
    # prepare_multi_gpu_env tests the raw values for truth: a quoted "false" counts as true there.
    if ram and not sync:
        _error(out, fsdp.key("fsdp_cpu_ram_efficient_loading"),
               f"Accelerate's launcher refuses {ram!r} together with `fsdp_sync_module_states: {sync}` "
               "(it tests the raw values, so even a quoted 'false' counts as on); write an unquoted "
               "`false`, or drop `fsdp_sync_module_states`.")


def _check_ignored_by_fsdp2(fsdp: _Fsdp, out: list[Finding]) -> None:
    """Keys Accelerate's FSDP2 plugin reads but throws away (with at most a log line)."""
    if fsdp.has("fsdp_sharding_strategy"):
        strategy = str(fsdp.raw("fsdp_sharding_strategy")).upper()
        hint = ("use `parallelism_config` (dp_replicate_size x dp_shard_size) for HSDP" if strategy.startswith("HYBRID")
                else "use `fsdp_reshard_after_forward` (FULL_SHARD -> true, SHARD_GRAD_OP -> false)")
        _warn(out, fsdp.key("fsdp_sharding_strategy"), f"ignored with FSDP2; {hint}.")
    prefetch = fsdp.raw("fsdp_backward_prefetch")
    if prefetch is not None:
        text = str(prefetch).upper()
        if text == "NO_PREFETCH":
            pass
        elif text not in _BACKWARD_PREFETCH and text not in ("1", "2"):
            _error(out, fsdp.key("fsdp_backward_prefetch"), f"{prefetch!r} is not one of BACKWARD_PRE, BACKWARD_POST, "
                                                            "NO_PREFETCH; Accelerate raises.")
        else:
            _warn(out, fsdp.key("fsdp_backward_prefetch"),
                  "ignored with FSDP2 (Accelerate sets it to None); hf_fsdp2 prefetches 1 layer in backward, set "
                  "another depth with HF_FSDP2_BACKWARD_PREFETCH=N or register(backward_prefetch=N).")
    if _launcher_bool(fsdp.raw("fsdp_forward_prefetch")):
        _warn(out, fsdp.key("fsdp_forward_prefetch"), "ignored with FSDP2 (Accelerate reads it for FSDP1 only); set "
                                                      "hf_fsdp2's forward prefetch depth with "
                                                      "HF_FSDP2_FORWARD_PREFETCH=N or register(forward_prefetch=N).")


def _check_state_dict_type(fsdp: _Fsdp, out: list[Finding]) -> None:
    value = fsdp.raw("fsdp_state_dict_type")
    if value is None:
        return
    text = str(value).upper()
    kind = _STATE_DICT_TYPES[int(text) - 1] if text in ("1", "2", "3") else text
    if kind not in _STATE_DICT_TYPES:
        _error(out, fsdp.key("fsdp_state_dict_type"), f"{value!r} is not SHARDED_STATE_DICT or FULL_STATE_DICT; "
                                                      "Accelerate raises.")
    elif kind == "LOCAL_STATE_DICT":
        _error(out, fsdp.key("fsdp_state_dict_type"), "FSDP2 has no LOCAL_STATE_DICT (Accelerate raises); use "
                                                      "SHARDED_STATE_DICT (hf_fsdp2 saves gather-free either way).")


# ---------------------------------------------------------------------------------------------
# parallelism_config


@dataclass
class _Parallel:
    sizes: dict[str, int]  # dp_replicate, dp_shard, tp, cp, sp
    given: bool


def _check_parallelism_config(cfg: Mapping[str, Any], out: list[Finding]) -> _Parallel:
    section = cfg.get("parallelism_config")
    parallel = _Parallel({"dp_replicate": 1, "dp_shard": 1, "tp": 1, "cp": 1, "sp": 1}, bool(section))
    if section is not None and not isinstance(section, dict):
        _error(out, "parallelism_config", f"must be a mapping of parallelism_config_* settings, got "
                                          f"{type(section).__name__}.")
        return parallel
    for key, value in (section or {}).items():
        full = f"parallelism_config.{key}"
        if key not in PARALLELISM_KEYS:
            prefixed = f"parallelism_config_{key}"
            close = prefixed if prefixed in PARALLELISM_KEYS else _closest(str(key), PARALLELISM_KEYS)
            hint = f"did you mean {close}?" if close else f"valid keys: {', '.join(sorted(PARALLELISM_KEYS))}."
            _error(out, full, f"Accelerate drops unknown parallelism_config keys silently (it adds no prefix); {hint}")
            continue
        dim = key.removeprefix("parallelism_config_").removesuffix("_size")
        if dim not in parallel.sizes:
            continue
        size = _int(value)
        if size is None or size < 1:
            _error(out, full, f"{value!r} must be an integer >= 1.")
            continue
        parallel.sizes[dim] = size
    if not parallel.given:
        return parallel

    if parallel.sizes["sp"] > 1:
        _error(out, "parallelism_config.parallelism_config_sp_size",
               f"{parallel.sizes['sp']}: Accelerate's sequence parallelism (DeepSpeed's Ulysses, sp_backend "
               "deepspeed) is not supported. Set it to 1; for hf_fsdp2's Ulysses x FSDP2 set HF_FSDP2_SP_SIZE in the "
               "launch's environment (the prepared data loader and model split the sequences), or use "
               "parallelism_config_cp_size (context parallelism).")
    backend = (section or {}).get("parallelism_config_cp_backend", "torch")
    if parallel.sizes["cp"] > 1 and backend != "torch":
        _error(out, "parallelism_config.parallelism_config_cp_backend",
               f"{backend!r}: hf_fsdp2 runs context parallelism with torch's ring attention only; set it to torch.")
    procs = _int(cfg.get("num_processes"))
    if procs is None or procs < 1:
        return parallel
    s = parallel.sizes
    total = s["dp_replicate"] * s["dp_shard"] * s["tp"] * s["cp"] * s["sp"]
    if total == 1 and procs > 1:
        _error(out, "parallelism_config", f"every size is 1: Accelerate makes all {procs} processes replicas "
                                          "(dp_replicate_size = num_processes) and then refuses FSDP with no "
                                          "dimension to shard over. Set parallelism_config_dp_shard_size, or remove "
                                          "parallelism_config for plain FSDP.")
        return parallel
    if total != procs:
        product = " x ".join(str(s[dim]) for dim in ("dp_replicate", "dp_shard", "tp", "cp", "sp"))
        _error(out, "parallelism_config", f"dp_replicate_size x dp_shard_size x tp_size x cp_size x sp_size = "
                                          f"{product} = {total}, but num_processes is {procs} (all processes on all "
                                          "machines).")
    elif s["dp_shard"] == 1 and s["cp"] == 1 and procs > 1:
        _error(out, "parallelism_config.parallelism_config_dp_shard_size",
               "1: FSDP needs ranks to shard over, and Accelerate refuses FSDP2 without a dp_shard dimension; "
               "make dp_shard_size > 1 (pure data parallelism is not FSDP).")
    machines = _int(cfg.get("num_machines", 1)) or 1
    if machines > 1 and s["dp_replicate"] != machines:
        _warn(out, "parallelism_config.parallelism_config_dp_replicate_size",
              f"{s['dp_replicate']} replica(s) on {machines} machines: the usual HSDP layout is one replica per "
              f"machine (dp_replicate_size = num_machines = {machines}), so that all-gathers stay inside a machine "
              "and only the gradient all-reduce crosses machines.")
    return parallel


# ---------------------------------------------------------------------------------------------
# What hf_fsdp2 would build from it


def fsdp2_values(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The `FSDP2Config` fields `config_from_accelerator` derives from this file (before `register()`
    overrides and HF_FSDP2_* variables), replaying the launcher's string round trip. Only meaningful
    for a file `check_accelerate_config_dict` finds no error in."""
    fsdp = _Fsdp({})
    for key, value in (cfg.get("fsdp_config") or {}).items():
        key = str(key)
        fsdp.given[key if key.startswith("fsdp") else "fsdp_" + key] = (key, value)
    policy = str(fsdp.raw("fsdp_auto_wrap_policy") or "NO_WRAP").upper()
    layers = fsdp.raw("fsdp_transformer_layer_cls_to_wrap")
    # The plugin splits the variable on commas, for TRANSFORMER_BASED_WRAP only; the integration cleans the pieces.
    plugin_names = str(layers).split(",") if layers is not None and policy == "TRANSFORMER_BASED_WRAP" else None
    mp = cfg.get("mixed_precision")
    if mp is None and cfg.get("fp16"):
        mp = "fp16"
    sizes = cfg.get("parallelism_config") or {}
    return accelerate_settings.fsdp2_values(accelerate_settings.AccelerateSettings(
        wrap_policy=policy,
        layer_names=plugin_names,
        min_num_params=_int(fsdp.raw("fsdp_min_num_params")) or 0,
        ignored_modules=str(fsdp.raw("fsdp_ignored_modules")) if fsdp.raw("fsdp_ignored_modules") else None,
        reshard_after_forward=_launcher_bool(fsdp.raw("fsdp_reshard_after_forward")),
        cpu_offload=bool(_launcher_bool(fsdp.raw("fsdp_offload_params"))),
        mixed_precision=str(mp),
        replicate_size=_int(sizes.get("parallelism_config_dp_replicate_size", 1)) or 1,
        shard_size=_int(sizes.get("parallelism_config_dp_shard_size", 1)) or 1,
        parallel_sizes={name: _int(sizes.get(f"parallelism_config_{name}", 1)) or 1
                        for name in ACCELERATE_PARALLEL_SIZES}))


def _check_fsdp2_config(cfg: Mapping[str, Any], fsdp: _Fsdp, parallel: _Parallel, out: list[Finding],
                        environ: Mapping[str, str] | None = None) -> None:
    """Run the file through the integration's mapping, with the HF_FSDP2_* variables of this environment (the
    launch's: what the yaml cannot carry, e.g. `ep_size`) on top; anything FSDP2Config rejects is an error."""
    via = ""
    try:
        overrides = accelerate_settings.env_overrides(environ)
        via = "".join(f" with {accelerate_settings.ENV_PREFIX}{k.upper()}={v}" for k, v in sorted(overrides.items()))
        config = FSDP2Config.from_dict({**fsdp2_values(cfg), **overrides}, source="the Accelerate config" + via)
        if config.sp_size > 1 and config.cp_size > 1 and "cp_size" not in overrides:
            # Accelerate's parallelism_config cp_size: the engine refuses it at prepare (that mesh has no "sp");
            # hf_fsdp2's own HF_FSDP2_CP_SIZE builds dp_shard x cp x sp (sharding/engine.ranks_sharing_rows)
            raise ValueError(f"`sp_size`={config.sp_size} with `cp_size`={config.cp_size} is not done under "
                             "Accelerate's parallelism_config_cp_size: its parallelism_config builds the cp mesh "
                             "without hf_fsdp2's sp dimension and maybe_context_parallel splits the batch for ring "
                             "attention alone. Leave parallelism_config_cp_size at 1 and launch with "
                             f"HF_FSDP2_CP_SIZE={config.cp_size} beside HF_FSDP2_SP_SIZE={config.sp_size}: ring CP x "
                             "Ulysses on hf_fsdp2's dp_shard x cp x sp mesh, each cp x sp group loading the same rows.")
        procs = _int(cfg.get("num_processes"))
        if procs and not config.is_auto_layout:  # an auto layout's shape is the planner's, at prepare
            config.mesh_shape(procs)
    except (ValueError, TypeError) as e:
        _error(out, "parallelism_config" if parallel.given else "fsdp_config", f"hf_fsdp2 would reject this{via}: {e}")


# ---------------------------------------------------------------------------------------------
# CLI rendering


def render(path: str | Path, findings: list[Finding]) -> str:
    """One line per finding, then a summary line naming the file."""
    lines = [str(f) for f in findings]
    errors = sum(f.level == "error" for f in findings)
    warnings = len(findings) - errors
    if not findings:
        lines.append(f"{path}: OK for hf_fsdp2")
    else:
        lines.append(f"{path}: {errors} error{'s' * (errors != 1)}, {warnings} warning{'s' * (warnings != 1)}")
    return "\n".join(lines)


__all__ = ["Finding", "ConfigFileError", "check_accelerate_config", "check_accelerate_config_dict", "fsdp2_values",
           "load_config_file", "render"]
