"""The Accelerate backend: `register()` routes Accelerate's FSDP2 paths through hf_fsdp2.

Accelerate has no plugin registry; its FSDP2 entry points are module-level names imported into
`accelerate/accelerator.py` (`fsdp2_prepare_model`) and `Accelerator` methods (`_prepare_fsdp2`,
`save_model`, `save_state`, `load_state`). `register()` replaces exactly those (declared, with why,
in runtime/upstream.py, which remembers the originals), and `unregister()` puts them back. This module
holds the prepare path; the checkpoint methods are accelerator_checkpoint.py's, the settings mapping
accelerate_settings.py's.

Settings come from Accelerate's own config (the yaml's `fsdp_config`, `mixed_precision`,
`parallelism_config`); what the yaml cannot carry (Accelerate drops unknown `fsdp_config` keys)
comes from `register(**overrides)` and then `HF_FSDP2_<FIELD>` environment variables, read in
`env_overrides()` and nowhere else. Precedence: Accelerate < register() < environment.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging
import os
import re
from typing import Any, Iterator

import torch
import torch.nn as nn

from ..config import ACCELERATE_PARALLEL_SIZES, FSDP2Config
from ..checkpoint import loading
from . import accelerator_checkpoint, deferred_load, fsdp1_configs, presharded
from . import trl as trl_backend
from .accelerate_settings import ENV_PREFIX, AccelerateSettings, env_overrides, fsdp2_values, layer_names  # noqa: F401 (ENV_PREFIX: re-exported)
from ..quantization import bnb_optimizers
from ..shard import shard_model
from ..sharding import engine, is_sharded
from ..sharding.record import ShardedModel, record_of, refuse_parameters_added_after, sharded
from ..sharding.model_parts import ModelParts, model_parts
from ..sharding.adopt import sharded_by_transformers
from ..runtime import upstream, versions

_USER_POLICY = "_hf_fsdp2_user_policy"  # set on a plugin whose mixed_precision_policy the user gave

GROUP = "accelerate"
_overrides: dict[str, Any] = {}
logger = logging.getLogger(__name__)


def check_version() -> None:
    """The backend patches Accelerate internals: refuse an Accelerate older than supported (a newer one warns at
    import; tests/test_upstream_contracts.py judges it)."""
    problem = [p for p in versions.problems() if p.startswith("accelerate")]
    if problem:
        raise RuntimeError(f"hf_fsdp2's Accelerate backend: {problem[0]}. Install a supported version "
                           "(e.g. `pip install 'accelerate==1.15.0'`).")


def is_registered() -> bool:
    return bool(upstream.installed(GROUP))


def register(**overrides: Any) -> None:
    """Route Accelerate's FSDP2 through hf_fsdp2. Idempotent; a second call replaces the overrides.

    `overrides`: `FSDP2Config` fields the yaml cannot carry, e.g. `frozen_dtype="bf16"`.
    """
    check_version()
    FSDP2Config.from_dict(overrides, source="register()")  # fail now, not at prepare()
    _overrides.clear()
    _overrides.update(overrides)
    if is_registered():
        return
    from accelerate import Accelerator

    upstream.replace("accelerate.accelerator.fsdp2_prepare_model", _fsdp2_prepare_model, GROUP)
    for name, wrapper in (("__init__", _init), ("_prepare_fsdp2", _prepare_fsdp2), ("_prepare_ao", _prepare_ao),
                          ("save_model", accelerator_checkpoint.save_model), ("prepare_model", _prepare_model),
                          ("save_state", accelerator_checkpoint.save_state),
                          ("load_state", accelerator_checkpoint.load_state), ("_prepare_tp", _prepare_tp),
                          ("prepare_data_loader", _prepare_data_loader),
                          ("gather_for_metrics", _gather_for_metrics)):
        upstream.replace(f"accelerate.accelerator.Accelerator.{name}",
                         functools.wraps(getattr(Accelerator, name))(wrapper), GROUP)
    upstream.replace(deferred_load.SEAM, classmethod(_from_pretrained), GROUP)
    trl_backend.install_if_imported(prepare_for_inference)


def _from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
    """transformers' `from_pretrained`, deferred to `prepare` under the auto layout with ram-efficient
    loading (integrations/deferred_load.py)."""
    if deferred_load.ram_efficient_fsdp2() and _shard_size_setting() == "auto":
        model = deferred_load.load_on_meta(cls, pretrained_model_name_or_path, args, kwargs)
        if model is not None:
            return model
    return upstream.original(deferred_load.SEAM, cls)(pretrained_model_name_or_path, *args, **kwargs)


def _shard_size_setting():
    """`shard_size` as register() and HF_FSDP2_SHARD_SIZE set it."""
    return _user_settings().get("shard_size")


def _user_settings() -> dict[str, Any]:
    """What register() and the HF_FSDP2_* environment set, the environment winning (module docstring)."""
    return {**_overrides, **env_overrides()}


def unregister() -> None:
    """Restore Accelerate's own behaviour (and TRL's)."""
    trl_backend.uninstall()
    upstream.restore(GROUP)
    _overrides.clear()


def take_back_foreign_patches() -> list[str]:
    """Frameworks patch Accelerate too (axolotl's `patch_accelerate_fsdp2()` rebinds
    `accelerate.accelerator.fsdp2_prepare_model` at model load, after `register()`): a name we
    replaced that now holds someone else's function would silently shard with their code. Put ours
    back, warning with the patch's module and name; returns those warnings. Called at every prepare."""
    taken = []
    for target, current in upstream.foreign(GROUP):
        where = f"{getattr(current, '__module__', '?')}.{getattr(current, '__qualname__', repr(current))}"
        message = (f"hf_fsdp2: `{target}` was replaced after hf_fsdp2.register() by `{where}`; hf_fsdp2 "
                   "takes it back so the model is sharded by hf_fsdp2 (call hf_fsdp2.unregister() before "
                   "that patch to use it instead).")
        logger.warning(message)
        taken.append(message)
        upstream.reinstate(target)
    return taken


def _original(owner_name: str, name: str):
    return upstream.original(f"accelerate.accelerator.{owner_name}.{name}")


# ---------------------------------------------------------------------------------------------
# Turning Accelerate's settings into an FSDP2Config


# Every field of Accelerate's `FullyShardedDataParallelPlugin` and what becomes of it with hf_fsdp2, so
# that none is dropped silently (tests check this covers the installed Accelerate's fields).
PLUGIN_FIELDS = {
    "fsdp_version": "2; an FSDP1 launch config is converted (fsdp1_configs.py), an FSDP1 plugin object refused",
    "reshard_after_forward": "honoured (fully_shard's reshard_after_forward)",
    "auto_wrap_policy": "honoured: TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP, NO_WRAP; a custom callable is refused",
    "transformer_cls_names_to_wrap": "honoured (absent classes are refused, listing the model's)",
    "min_num_params": "honoured with SIZE_BASED_WRAP",
    "ignored_modules": "honoured (regex or modules): left out of every group",
    "cpu_offload": "honoured (CPUOffloadPolicy)",
    "mixed_precision_policy": "honoured (param/reduce/output dtypes); cast_forward_inputs=False is refused",
    "activation_checkpointing": "honoured by Accelerate's own fsdp2_apply_ac before sharding",
    "activation_checkpointing_offload": "honoured by Accelerate's own fsdp2_apply_ac",
    "cpu_ram_efficient_loading": "honoured: rank 0's weights are broadcast into the shards",
    "state_dict_type": "accepted: hf_fsdp2 writes the same gather-free safetensors for either type",
    "state_dict_config": "used by Accelerate's get_state_dict only; save_model/save_state never gather",
    "optim_state_dict_config": "used by Accelerate's get_state_dict only; save_model/save_state never gather",
    "sharding_strategy": "Accelerate: FSDP1's; with FSDP2 it warns, or raises when reshard_after_forward is unset",
    "backward_prefetch": "Accelerate: FSDP1's; with FSDP2 it warns and sets None (hf_fsdp2: backward_prefetch)",
    "forward_prefetch": "Accelerate: FSDP1's; with FSDP2 it raises (hf_fsdp2: forward_prefetch)",
    "use_orig_params": "Accelerate: obsolete with FSDP2, it warns",
    "sync_module_states": "Accelerate: obsolete with FSDP2, it warns (cpu_ram_efficient_loading broadcasts)",
    "limit_all_gathers": "FSDP1's rate limiter; FSDP2 has none: False is refused, not ignored",
    "param_init_fn": "FSDP1's; stock FSDP2 ignores it silently, hf_fsdp2 refuses it",
}


def _refuse_fsdp1_only(plugin) -> None:
    """Fields stock Accelerate's FSDP2 path ignores without a word."""
    if getattr(plugin, "param_init_fn", None) is not None:
        raise ValueError("FullyShardedDataParallelPlugin(param_init_fn=...) is FSDP1's and has no effect with FSDP2; "
                         "hf_fsdp2 materialises meta-device models itself (shard_model(init_weights=True), "
                         "hf_fsdp2.from_pretrained, or fsdp_cpu_ram_efficient_loading). Remove param_init_fn.")
    if getattr(plugin, "limit_all_gathers", True) is False:
        raise ValueError("FullyShardedDataParallelPlugin(limit_all_gathers=False) / fsdp_config `limit_all_gathers` "
                         "is FSDP1's rate limiter and has no effect with FSDP2; remove it (hf_fsdp2 bounds "
                         "in-flight all-gathers by its forward_prefetch/backward_prefetch depths).")


def config_from_accelerator(accelerator) -> FSDP2Config:
    plugin = accelerator.state.fsdp_plugin
    from torch.distributed.fsdp import CPUOffloadPolicy

    _refuse_fsdp1_only(plugin)
    # what Accelerate's settings ask of a technique hf_fsdp2 runs otherwise (FP8's backend, parallelism_config's
    # sequence-parallel size and CP backend), refused by name where the model is prepared, before being ignored
    engine.refuse_accelerate_settings(accelerator)
    pc = getattr(accelerator, "parallelism_config", None)
    values = fsdp2_values(AccelerateSettings(
        **_wrap_policy(plugin),
        layer_names=plugin.transformer_cls_names_to_wrap,
        reshard_after_forward=plugin.reshard_after_forward,
        cpu_offload=isinstance(plugin.cpu_offload, CPUOffloadPolicy) or plugin.cpu_offload is True,
        mixed_precision=str(accelerator.mixed_precision),
        replicate_size=getattr(pc, "dp_replicate_size", 1) if pc is not None else 1,
        shard_size=getattr(pc, "dp_shard_size", 1) if pc is not None else 1,
        parallel_sizes={name: getattr(pc, name, 1) for name in ACCELERATE_PARALLEL_SIZES} if pc is not None else {}))
    policy = getattr(plugin, _USER_POLICY, None)
    if policy is not None:
        values.update(_policy_dtypes(policy))
    values.update(_ddp_settings(accelerator))
    values.update(_user_settings())
    return FSDP2Config.from_dict(values, source="Accelerate config")


# DistributedDataParallelKwargs fields (the Trainer's ddp_* arguments) that hf_fsdp2's replication
# (sharding/replication.py, shard size 1) takes; FSDP2 groups need none of them.
_DDP_FIELDS = ("find_unused_parameters", "bucket_cap_mb")


def _ddp_settings(accelerator) -> dict[str, Any]:
    """The DDP settings a script or the Trainer gave Accelerate (`DistributedDataParallelKwargs`), for
    replication with DDP's reducer; the others it sets are said not to apply (rank 0)."""
    handler = getattr(accelerator, "ddp_handler", None)
    given = handler.to_kwargs() if handler is not None else {}
    others = sorted(set(given) - set(_DDP_FIELDS))
    if others and accelerator.is_main_process:
        logging.getLogger("hf_fsdp2").warning(
            "DistributedDataParallelKwargs %s: not applied (hf_fsdp2 takes find_unused_parameters and bucket_cap_mb "
            "for shard size 1, where it replicates with DDP's reducer; buffers are not broadcast, as under FSDP2).",
            ", ".join(f"{k}={given[k]!r}" for k in others))
    return {k: given[k] for k in _DDP_FIELDS if k in given}


def _policy_dtypes(policy) -> dict[str, Any]:
    """A `mixed_precision_policy` given to the plugin (torch's MixedPrecisionPolicy, or the dict / str
    Accelerate turns into one): honoured as given, reduce dtype included."""
    if getattr(policy, "cast_forward_inputs", True) is False:
        raise ValueError("FullyShardedDataParallelPlugin(mixed_precision_policy=...): cast_forward_inputs=False is "
                         "not supported by hf_fsdp2 (each group casts its floating-point inputs to param_dtype).")
    return {"param_dtype": policy.param_dtype, "reduce_dtype": policy.reduce_dtype,
            "output_dtype": policy.output_dtype}


def _wrap_policy(plugin) -> dict[str, Any]:
    """Accelerate's `auto_wrap_policy` (a torch wrap function, a partial of one, or None for NO_WRAP,
    as `FullyShardedDataParallelPlugin.__post_init__` leaves it), `min_num_params`, `ignored_modules`."""
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

    fn = plugin.auto_wrap_policy
    fn = fn.func if isinstance(fn, functools.partial) else fn
    if fn is None:
        values: dict[str, Any] = {"wrap_policy": "none"}
    elif fn is transformer_auto_wrap_policy:
        values = {"wrap_policy": "transformer"}
    elif fn is size_based_auto_wrap_policy:
        values = {"wrap_policy": "size", "min_num_params": plugin.min_num_params or 0}
    else:
        raise ValueError(f"fsdp_auto_wrap_policy: a custom policy ({getattr(fn, '__name__', fn)!r}) is not supported "
                         "by hf_fsdp2; use TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP or NO_WRAP.")
    if isinstance(plugin.ignored_modules, str) and plugin.ignored_modules:
        values["ignored_modules"] = plugin.ignored_modules
    return values


def _module_names_pattern(model: nn.Module, modules) -> str:
    """`ignored_modules` given as module objects (Python API) -> a regex of their exact names."""
    wanted = {id(m) for m in modules}
    names = [re.escape(name) for name, m in model.named_modules() if id(m) in wanted]
    if len(names) < len(wanted):
        raise ValueError("`ignored_modules`: some of the given modules are not part of the prepared model.")
    return "|".join(names)


# ---------------------------------------------------------------------------------------------
# Replacements


def _init(self, *args, **kwargs):
    """Accelerator.__init__, then engage FSDP on a CPU-only machine too.

    Accelerate only turns FSDP on for GPU-like distributed types; with gloo on CPU it silently runs
    unsynchronised replicas (state.py: the `DistributedType.FSDP` switch excludes MULTI_CPU).
    An FSDP1 config (no `fsdp_version`, as PEFT's examples publish them) would bypass hf_fsdp2 on GPUs
    and be refused on CPUs: it is converted to FSDP2 first (integrations/fsdp1_configs.py).
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    trl_backend.install_if_imported(prepare_for_inference)  # a TRL trainer builds its Accelerator before preparing its other models
    given = kwargs.get("fsdp_plugin")
    if given is None:  # Accelerate builds its plugin from the FSDP_* variables: an FSDP1 config runs as FSDP2
        converted = fsdp1_configs.convert_environment()
        if converted:
            logger.warning("hf_fsdp2: the Accelerate config is FSDP1's; it runs as FSDP2 with Accelerate's own "
                           "mapping (accelerate to-fsdp2): " + "; ".join(converted))
    if given is not None and given.mixed_precision_policy is not None:
        # The user's own policy; Accelerator.__init__ fills an unset one from `mixed_precision` later.
        upstream.tag(given, _USER_POLICY, given.mixed_precision_policy)
    wants_fsdp = kwargs.get("fsdp_plugin") is not None or os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true"
    if not (wants_fsdp and not _has_accelerator_device()):
        _original("Accelerator", "__init__")(self, *args, **kwargs)
        if getattr(self.state, "fsdp_plugin", None) is not None:
            _refuse_fsdp1(self.state.fsdp_plugin)  # else Accelerate's FSDP1 would run, not hf_fsdp2
        return
    # Without `cpu=True` PartialState sees no device and picks DistributedType.NO: every rank would
    # train alone. With it, it starts gloo (MULTI_CPU), which we turn into FSDP below. The
    # ParallelismConfig check inside __init__ rejects MULTI_CPU, so it runs after the switch.
    kwargs["cpu"] = True
    with upstream.scoped("accelerate.parallelism_config.ParallelismConfig._validate_accelerator",
                         lambda validate: lambda config, accelerator: None):
        _original("Accelerator", "__init__")(self, *args, **kwargs)
    state = self.state
    if state.distributed_type == DistributedType.MULTI_CPU:
        plugin = kwargs.get("fsdp_plugin") or FullyShardedDataParallelPlugin()
        _refuse_fsdp1(plugin)
        if self.mixed_precision != "no":
            plugin.set_mixed_precision(self.mixed_precision)
        upstream.set_state(state, "fsdp_plugin", plugin, "accelerate.state.AcceleratorState.fsdp_plugin")
        upstream.set_state(state, "distributed_type", DistributedType.FSDP,
                           "accelerate.state.AcceleratorState.distributed_type")
        # AcceleratorState mirrors its type into PartialState's shared state (state.py, end of __init__).
        upstream.set_entry(PartialState, "_shared_state", "distributed_type", DistributedType.FSDP,
                           "accelerate.state.PartialState._shared_state")
    if self.parallelism_config:
        self.parallelism_config._validate_accelerator(self)


def _refuse_fsdp1(plugin) -> None:
    if plugin.fsdp_version != 2:
        raise ValueError(f"FullyShardedDataParallelPlugin(fsdp_version={plugin.fsdp_version}): hf_fsdp2 is registered "
                         "and runs FSDP2 only; pass fsdp_version=2 (an FSDP1 launch config is converted by itself).")


def _has_accelerator_device() -> bool:
    from accelerate.utils import is_xpu_available

    return torch.cuda.is_available() or is_xpu_available()


def _prepare_fsdp2(self, *args):
    """Normalise the plugin's layer names before Accelerate resolves them (a yaml list arrives as
    "['A', 'B']"; a PeftModel has no `_no_split_modules`, its base model does)."""
    take_back_foreign_patches()  # before Accelerate calls `fsdp2_prepare_model`
    for optimizer in (a for a in args if isinstance(a, torch.optim.Optimizer)):
        bnb_optimizers.prepare(optimizer)  # 8-bit optimizers step on each rank's rows
    plugin = self.state.fsdp_plugin
    model = next((a for a in args if isinstance(a, nn.Module)), None)
    state = _Prepared.of(model) if model is not None else None  # looked up once, handed to each step
    names = layer_names(plugin.transformer_cls_names_to_wrap)
    if names is None and state is not None:
        names = list(getattr(state.parts.base, "_no_split_modules", None) or []) or None
    upstream.set_state(plugin, "transformer_cls_names_to_wrap", names,
                       "accelerate.utils.dataclasses.FullyShardedDataParallelPlugin.transformer_cls_names_to_wrap")
    deferred = state is not None and state.record.deferred_checkpoint is not None
    optimizer_names = deferred_load.optimizer_parameter_names(args, model) if deferred else None
    ours_already = state is not None and state.ours
    with (presharded.prepared_as_it_is(model, config_from_accelerator(self), plugin, state.record) if ours_already
          else contextlib.nullcontext()), _regional_compilation_in_place(), \
            _wrap_policy_of_a_presharded(state is not None and (state.by_transformers or state.ours)), \
            _preparing(state):
        result = _original("Accelerator", "_prepare_fsdp2")(self, *args)
    if deferred:  # Accelerate maps optimizer parameters by data_ptr(), 0 for every meta parameter
        deferred_load.repoint_optimizers(result, optimizer_names)
    prepared = next((r for r in result if isinstance(r, nn.Module)), None)
    parts, record = (state.parts, state.record) if state is not None and prepared is model else (None, None)
    if prepared is not None and parts is None:  # not prepared in place: its own lookup
        parts = model_parts(prepared)
        record = record_of(parts)
    if prepared is not None:  # what the techniques keep from prepare on (the loader's rows split in forward, ...)
        engine.prepared_by_accelerate(prepared, parts, record,
                                      [r for r in result if isinstance(r, torch.optim.Optimizer)])
    return result


@dataclasses.dataclass(frozen=True)
class _Prepared:
    """A model Accelerate's prepare was given, looked up once where it comes in (`_prepare_fsdp2`) and handed to
    each step, `_fsdp2_prepare_model` included (Accelerate calls it with the bare model: `_preparing`): its parts,
    its record (made here: prepare shards it, or keeps it), and what it was when prepare began."""

    parts: ModelParts
    record: ShardedModel
    ours: bool  # sharded by hf_fsdp2 before prepare (hf_fsdp2.from_pretrained)
    by_transformers: bool  # sharded by transformers at load (sharding/adopt.py)

    @staticmethod
    def of(model: nn.Module) -> _Prepared:
        parts = model_parts(model)
        record = record_of(parts, create=True)
        # Accelerate would pass it through: FSDP2 modules are in it
        refuse_parameters_added_after(record, (name for name, _ in parts.base.named_parameters()),
                                      type(parts.base).__name__)
        ours = sharded(record, id(model), parts.has_peft)
        return _Prepared(parts, record, ours, sharded_by_transformers(model))


_PREPARING: contextvars.ContextVar[_Prepared | None] = contextvars.ContextVar("hf_fsdp2_preparing", default=None)


@contextlib.contextmanager
def _preparing(state: _Prepared | None) -> Iterator[None]:
    """`state` for the `_fsdp2_prepare_model` Accelerate's `_prepare_fsdp2` calls inside (with the model alone)."""
    token = _PREPARING.set(state)
    try:
        yield
    finally:
        _PREPARING.reset(token)


def _wrap_policy_of_a_presharded(presharded: bool):
    """Accelerate resolves the plugin's wrap classes against the model before sharding
    (`set_auto_wrap_policy`); a model sharded before prepare, by transformers at load (sharding/adopt.py)
    or by hf_fsdp2.from_pretrained (presharded.py), has FSDP<Name> classes, so that lookup fails. It is
    already grouped (`presharded`): the lookup is skipped for it, and its groups are checked against the plugin's
    settings instead (`shard_model` for transformers', `presharded.keep_presharded` for ours)."""
    if not presharded:
        return contextlib.nullcontext()
    return upstream.scoped("accelerate.utils.dataclasses.FullyShardedDataParallelPlugin.set_auto_wrap_policy",
                           lambda original: lambda plugin, model: None)


@contextlib.contextmanager
def _regional_compilation_in_place():
    """Accelerate < 1.14's `_prepare_fsdp2` compiles regions with `compile_regions`, which wraps each block
    in an `OptimizedModule`: parameter names gain `._orig_mod.` (a saved model then loads with random
    weights, silently) and shard_size="auto" traces compiled layers on meta. Accelerate >= 1.14 calls
    `compile_regions_fsdp2` (in place, as `compile_regions_deepspeed` does): the older ones get that."""
    import accelerate.accelerator as acc_module

    if hasattr(acc_module, "compile_regions_fsdp2") or not hasattr(acc_module, "compile_regions"):
        yield
        return
    from accelerate.utils import compile_regions_deepspeed

    def in_place(original):
        def compile_regions(module: nn.Module, **compile_kwargs: Any) -> nn.Module:
            compile_regions_deepspeed(module, **compile_kwargs)
            return module
        return compile_regions

    with upstream.scoped("accelerate.accelerator.compile_regions", in_place):
        yield


def _prepare_data_loader(self, data_loader, device_placement=None, slice_fn_for_dispatch=None):
    """Accelerator.prepare_data_loader. Where n neighbouring ranks must load the same rows (engine.ranks_sharing_rows:
    the prepared model's training forward splits them), Accelerate's loader is built for the data-parallel ranks
    only, world / n of them, rank // n being a rank's data-parallel index."""
    original = _original("Accelerator", "prepare_data_loader")
    shared = ranks_sharing_rows(self)
    if shared == 1:
        return original(self, data_loader, device_placement, slice_fn_for_dispatch)
    from accelerate.data_loader import DataLoaderDispatcher

    def data_parallel_only(prepare):
        def prepare_data_loader(*args, **kwargs):
            kwargs.update(num_processes=kwargs["num_processes"] // shared,
                          process_index=kwargs["process_index"] // shared, torch_device_mesh=None)
            return prepare(*args, **kwargs)
        return prepare_data_loader

    with upstream.scoped("accelerate.accelerator.prepare_data_loader", data_parallel_only):
        prepared = original(self, data_loader, device_placement, slice_fn_for_dispatch)
    if isinstance(prepared, DataLoaderDispatcher):  # it slices rank 0's batches by the state's rank, not ours
        engine.refuse_dispatched_rows(shared)
    return prepared


def _gather_for_metrics(self, input_data, use_gather_object=False):
    """Accelerator.gather_for_metrics. Where n neighbouring ranks hold the same rows (engine.ranks_sharing_rows: their
    loader's, and evaluation runs whole sequences on each), a gather over every rank would count each row n times and
    cut the last batch's remainder from the wrong ones: the gathered data keep one rank of each group (its first),
    what the data-parallel ranks hold. Accelerate's own gather (the Trainer's token count, its logged loss) is left
    as it is."""
    original = _original("Accelerator", "gather_for_metrics")
    shared = engine.ranks_sharing_rows(_user_config()) if getattr(self, "is_fsdp2", False) else 1
    if shared == 1:
        return original(self, input_data, use_gather_object)
    from accelerate.utils import recursively_apply

    world = self.num_processes

    def one_per_group(tensor: torch.Tensor) -> torch.Tensor:  # each rank's equal block, in rank order
        return tensor.reshape(world, -1, *tensor.shape[1:])[::shared].reshape(-1, *tensor.shape[1:])

    def gather(original_gather):
        return lambda accelerator, data: recursively_apply(one_per_group, original_gather(accelerator, data))

    def gather_object(original_gather_object):
        def gathered(obj):  # as Accelerate's _gpu_gather_object: a list per rank, flattened
            per_rank = [None] * world
            torch.distributed.all_gather_object(per_rank, obj)
            return [x for rank, items in enumerate(per_rank) if rank % shared == 0 for x in items]
        return gathered

    with upstream.scoped("accelerate.accelerator.Accelerator.gather", gather), \
            upstream.scoped("accelerate.accelerator.gather_object", gather_object):
        return original(self, input_data, use_gather_object)


def _user_config() -> FSDP2Config:
    """The settings register() and HF_FSDP2_* variables give, alone (what the loader needs before a model)."""
    return FSDP2Config.from_dict(_user_settings(), source="register() and HF_FSDP2_* variables")


def ranks_sharing_rows(accelerator) -> int:
    """engine.ranks_sharing_rows for this accelerator: as register() / HF_FSDP2_* set it, refused by name where
    Accelerate does not hand the model to hf_fsdp2; then as the whole config (Accelerate's settings too) has it."""
    shared = engine.ranks_sharing_rows(_user_config(), getattr(accelerator, "is_fsdp2", False))
    return engine.ranks_sharing_rows(config_from_accelerator(accelerator)) if shared > 1 else 1


def _prepare_tp(self, *args):
    """Accelerate's TP step runs before FSDP2's and, under FSDP2, wraps every plain parameter with
    `transformers.integrations.tensor_parallel.ReplicateParallel`, which transformers 5.x no longer has
    (an ImportError for every TP run). Under hf_fsdp2 the model's TP is applied in `fsdp2_prepare_model`
    (sharding/tensor_parallel.py, transformers' own plan), so this step passes everything on."""
    if getattr(self, "is_fsdp2", False):
        return args
    return _original("Accelerator", "_prepare_tp")(self, *args)


def _prepare_ao(self, *args):
    """Accelerate's torchao FP8 step runs before FSDP2's: under FSDP2, shard_model converts the
    layers itself (config `fp8`, which `mixed_precision: fp8` sets) and `_prepare_fsdp2` hooks the
    optimizer, so Accelerate's conversion (every linear but the first and last) is skipped."""
    if getattr(self, "is_fsdp2", False):
        return args
    return _original("Accelerator", "_prepare_ao")(self, *args)


def prepare_for_inference(accelerator, model: nn.Module) -> nn.Module:
    """A model that only runs forwards (a reference, teacher, reward or value model, an eval-only
    model): sharded like the trained one (per-layer groups, the config's precision and layout), frozen
    (no gradients, no optimizer state), and every group resharded after its forward (no backward
    follows, so nothing is kept gathered between steps). Collective: call on every rank."""
    if not is_sharded(model):  # an entry of its own (TRL's models, evaluation_mode): looked up here
        model.requires_grad_(False)
        _fsdp2_prepare_model(accelerator, model)
        model.set_reshard_after_forward(True)
    model.eval()
    return model


def _prepare_model(self, model, device_placement=None, evaluation_mode=False):
    """`prepare_model(model, evaluation_mode=True)` (TRL's reward models, eval-only models): stock FSDP2
    only places such a model, a full replica on every rank; under hf_fsdp2 it is sharded for inference."""
    if evaluation_mode and getattr(self, "is_fsdp2", False) and isinstance(model, nn.Module):
        return prepare_for_inference(self, model)
    return _original("Accelerator", "prepare_model")(self, model, device_placement, evaluation_mode)


def _fsdp2_prepare_model(accelerator, model: nn.Module) -> nn.Module:
    """Replaces `accelerate.utils.fsdp_utils.fsdp2_prepare_model`: shard with hf_fsdp2. The model as
    `_prepare_fsdp2` looked it up (Accelerate hands on the model alone), else looked up here."""
    state = _PREPARING.get()
    if state is None or state.parts.model is not model:
        state = _Prepared.of(model)
    if state.ours:  # sharded before prepare (hf_fsdp2.from_pretrained: checked in _prepare_fsdp2)
        return model
    config = config_from_accelerator(accelerator)
    ignored = accelerator.state.fsdp_plugin.ignored_modules
    if ignored is not None and not isinstance(ignored, str):
        config = config.replace(ignored_modules=_module_names_pattern(model, ignored))
    if state.by_transformers:  # from_pretrained(distributed_config=...) sharded it at load:
        return shard_model(model, config)  # kept as it is, on its own mesh (sharding/adopt.py)
    record = state.record
    directory = record.deferred_checkpoint  # built on meta everywhere by transformers' from_pretrained
    given_values = None
    if directory is not None:  # what was changed since, kept for the fill or refused
        given_values = deferred_load.keep_changes(state.parts, record)
    if accelerator.mixed_precision != "no":
        # Mixed precision keeps fp32 master weights for what trains (as Accelerate does);
        # frozen weights stay as they are, or in `frozen_dtype`.
        for param in model.parameters():
            if param.requires_grad and param.is_floating_point() and param.dtype != torch.float32:
                param.data = param.data.float()
    # With rank-0 loading the other ranks hold the model on meta: the planner needs only its shapes
    # (it costs a meta copy), so every rank makes the same plan.
    from_rank0 = getattr(accelerator.state.fsdp_plugin, "cpu_ram_efficient_loading", False)
    # With TP, the accelerator's own mesh ("dp_replicate", "dp_shard", "tp"): a model transformers split
    # at load (`device_mesh=accelerator.torch_device_mesh`) is on its "tp" dimension already. With CP,
    # too: `maybe_context_parallel` splits sequences over its "cp" dimension, FSDP2 shards over
    # "dp_shard_cp" (sharding/context_parallel.py). That mesh is given, so the auto layout keeps its shape.
    given = accelerator.torch_device_mesh if any(getattr(config, name) > 1 for name in ACCELERATE_PARALLEL_SIZES) \
        else None
    if directory is not None:  # built on meta everywhere: each rank reads its rows
        fill = loading.Deferred(directory, given_values)
    else:  # fsdp_cpu_ram_efficient_loading: rank 0's weights; else the model's own
        fill = loading.FromRank0() if from_rank0 else loading.INITIALISE
    layout = loading.plan_for(state.parts, config, fill, mesh=given, record=record)
    engine.prepare_accelerator(accelerator, config)  # the accelerator's own contexts checked (CP's sequence lengths)
    model = loading.shard_and_fill(model, layout, fill)
    if directory is not None:
        deferred_load.filled(record)  # loads and forwards from now on are torch's own
    return model


