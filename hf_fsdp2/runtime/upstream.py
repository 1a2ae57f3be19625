"""Every place hf_fsdp2 replaces or extends another library's code: one table, one mechanism.

`SEAMS` lists each one: the upstream target (import path, then attribute path), how we touch it, the
hf_fsdp2 module that does, and why. Nothing else in the package assigns to another library's
attributes or swaps an object's class (tests/test_upstream_contracts.py scans the source for it), so
this table is the whole list. The same test records, per target, the signature and source hash of
the upstream code on every version it was checked on (tests/upstream_contracts.json, with the
versions) and fails naming the target when a release changes it: that, not the import, decides
whether a new release still fits.

How:
- PATCHED: the attribute is replaced while its group is installed (`replace`) and put back with the
  group (`restore`); `original` reaches the upstream function; `foreign` finds a replacement that a
  framework rebound after us (axolotl's `patch_accelerate_fsdp2()` at model load).
- SCOPED: replaced only inside a `with scoped(...)` block.
- CLASS_SWAPPED: an instance's `__class__` set to a subclass (`set_class`); the subclass keeps the
  name, so class-name lookups (`_no_split_modules`, conversion mappings) and isinstance hold.
- SUBCLASSED: a private upstream class we subclass and hand to upstream code.
- INSTANCE_WRAPPED: a method wrapped on one object hf_fsdp2 sharded (`wrap_instance_method`), its
  class untouched.
- REGISTERED: entries added to an upstream registry (a dict) that upstream code reads (`add_entries`);
  the contract recorded is that of the reading function (`reader`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import sys
from typing import Any, Callable, Iterator

PATCHED = "patched while installed"
SCOPED = "patched inside a with-block"
CLASS_SWAPPED = "instance class set to a subclass"
SUBCLASSED = "private class subclassed"
INSTANCE_WRAPPED = "method wrapped on one instance"
REGISTERED = "entries added to a registry"


@dataclasses.dataclass(frozen=True)
class Seam:
    target: str
    how: str
    user: str  # the hf_fsdp2 module that does it
    why: str
    # Modules under this prefix that bound the target's name at import (`from x import f`) are
    # rebound too, now and at restore (TRL's trainers import `prepare_fsdp` that way).
    rebind_prefix: str | None = None
    # The target exists only in newer releases of the supported range; where it is absent the seam is
    # not installed (and the contract test does not look for it).
    where_present: bool = False
    # REGISTERED: the upstream function that reads the registry; its contract is the one recorded.
    reader: str | None = None


_ACC = "integrations/accelerate.py"
_TR = "integrations/trainer.py"
SEAMS: tuple[Seam, ...] = (
    # Accelerate (group "accelerate", installed by register()). Accelerate has no plugin registry.
    Seam("accelerate.accelerator.fsdp2_prepare_model", PATCHED, _ACC,
         "shard with hf_fsdp2 instead of Accelerate's root-level fully_shard"),
    Seam("accelerate.accelerator.Accelerator.__init__", PATCHED, _ACC,
         "CPU-only FSDP: Accelerate picks MULTI_CPU without a device; we turn it into FSDP on gloo"),
    Seam("accelerate.accelerator.Accelerator._prepare_fsdp2", PATCHED, _ACC,
         "layer names from a yaml string or the PEFT base's _no_split_modules; FP8 scale hook on optimizers"),
    Seam("accelerate.accelerator.Accelerator._prepare_ao", PATCHED, _ACC,
         "under FSDP2, FP8 conversion happens in shard_model (per layer group), not Accelerate's"),
    Seam("accelerate.accelerator.Accelerator._prepare_tp", PATCHED, _ACC,
         "under FSDP2 it imports transformers' removed ReplicateParallel; hf_fsdp2 applies the model's TP plan "
         "in fsdp2_prepare_model (sharding/tensor_parallel.py)"),
    Seam("accelerate.accelerator.Accelerator.prepare_model", PATCHED, _ACC,
         "evaluation_mode=True (reward, eval-only models): stock FSDP2 keeps a full replica per rank; "
         "hf_fsdp2 shards it for inference"),
    Seam("accelerate.accelerator.Accelerator.save_model", PATCHED, "integrations/accelerator_checkpoint.py",
         "gather-free safetensors in Hugging Face format"),
    Seam("accelerate.accelerator.Accelerator.save_state", PATCHED, "integrations/accelerator_checkpoint.py",
         "gather-free, atomic training state (optionally in the background)"),
    Seam("accelerate.accelerator.Accelerator.load_state", PATCHED, "integrations/accelerator_checkpoint.py",
         "each rank reads only its own rows, whatever the saving mesh"),
    Seam("accelerate.accelerator.compile_regions", SCOPED, _ACC,
         "Accelerate < 1.14 compiles regions by wrapping blocks (`._orig_mod.` in every saved name); during "
         "_prepare_fsdp2 it compiles in place, as >= 1.14's compile_regions_fsdp2 does"),
    Seam("accelerate.utils.dataclasses.FullyShardedDataParallelPlugin.set_auto_wrap_policy", SCOPED, _ACC,
         "a model transformers sharded at load shows FSDP<Name> classes, so Accelerate's wrap-class lookup "
         "fails; during _prepare_fsdp2 of such a model it is skipped (sharding/adopt.py checks the names)"),
    Seam("accelerate.accelerator.Accelerator._prepare_cp", INSTANCE_WRAPPED, _ACC,
         "the `_cp_context` it sets (torch's context_parallel on the cp mesh, what maybe_context_parallel enters) is "
         "wrapped on the prepared accelerator: a sequence length cp_size does not divide is refused by name (torch "
         "would split it unevenly and its ring attention would fail inside)"),
    Seam("accelerate.parallelism_config.ParallelismConfig._validate_accelerator", SCOPED, _ACC,
         "it rejects the MULTI_CPU state that Accelerator.__init__ passes through before we make it FSDP"),
    Seam("transformers.modeling_utils.PreTrainedModel.from_pretrained", PATCHED, "integrations/deferred_load.py",
         "with fsdp_cpu_ram_efficient_loading and shard_size='auto': built on meta on every rank, each rank's "
         "rows read at prepare (transformers reads the whole checkpoint on every rank)"),
    # The Transformers Trainer (group "trainer", installed by register()).
    Seam("transformers.TrainingArguments.__post_init__", PATCHED, _TR,
         "the Trainer flag: fsdp settings from the arguments, CPU-only FSDP allowed"),
    Seam("transformers.Trainer.save_model", PATCHED, _TR, "gather-free save of a model we sharded"),
    Seam("transformers.Trainer._save_checkpoint", PATCHED, _TR,
         "checkpoints as safetensors training states (no optimizer.pt pickles), rotation kept"),
    Seam("transformers.Trainer._load_from_checkpoint", PATCHED, _TR, "resume reads each rank's own rows"),
    Seam("transformers.Trainer._load_optimizer_and_scheduler", PATCHED, _TR,
         "the optimizer state comes from our training state"),
    Seam("transformers.Trainer._load_rng_state", PATCHED, _TR, "RNG state from our training state"),
    Seam("transformers.Trainer._load_scaler", PATCHED, _TR, "the grad scaler from our training state"),
    Seam("transformers.Trainer._load_best_model", PATCHED, _TR, "load_best_model_at_end without gathering"),
    # torch.
    Seam("torch.distributed.destroy_process_group", PATCHED, "checkpoint/async_save.py",
         "a background save still needs its agreement group: wait for it before the groups go"),
    Seam("torch.nn.Module.register_parameter", SCOPED, "checkpoint/pretrained.py",
         "build a model with parameters on meta but real buffers (rotary inv_freq is not in checkpoints)"),
    Seam("torch.distributed.fsdp._fully_shard._fully_shard.fully_shard", CLASS_SWAPPED,
         "checkpoint/key_conversion.py",
         "fully_shard makes each module an FSDP<Name>(FSDPModule, Name); transformers finds weight "
         "conversions by class name, so the lookup is shown the original classes"),
    Seam("torch.distributed._composable.replicate.replicate", CLASS_SWAPPED, "checkpoint/key_conversion.py",
         "replicate (shard size 1, sharding/replication.py) makes the model a DDP<Name>(DDP, Name); as for "
         "fully_shard, transformers' conversion lookup is shown the original class"),
    Seam("torch.nn.Module.__getattr__", CLASS_SWAPPED, "sharding/compiled_collectives.py",
         "compile='model' stores each parameter sharded and reads it gathered inside forward: every module "
         "holding parameters becomes a same-named subclass whose properties are found before "
         "nn.Module.__getattr__ would read _parameters (SimpleFSDP's form, torchtitan)"),
    Seam("torch.distributed.fsdp._fully_shard._fsdp_collectives.DefaultAllGather.__call__", SUBCLASSED,
         "quantization/fp8.py", "gloo has no float8 dtype: float8 all-gather inputs travel as bytes"),
    Seam("transformers.modeling_utils.PreTrainedModel.resize_token_embeddings", INSTANCE_WRAPPED,
         "integrations/deferred_load.py",
         "a model whose weights load at prepare (deferred loading) refuses resizing by name: its values are on meta"),
    Seam("transformers.modeling_utils.PreTrainedModel.save_pretrained", INSTANCE_WRAPPED,
         "integrations/deferred_load.py",
         "a model whose weights load at prepare (deferred loading) refuses saving by name: it would write no weights"),
    Seam("transformers.generation.utils.GenerationMixin.generate", INSTANCE_WRAPPED, "sharding/generation.py",
         "on a model hf_fsdp2 sharded, each group is gathered once per generate() call, not once per token"),
    Seam("torch.distributed.tensor.experimental._context_parallel._attention.custom_ops", REGISTERED,
         "sharding/context_parallel.py",
         "torch's ring attention (context parallelism) handles the CUDA SDPA kernels only; the CPU flash kernel "
         "gets the same ring attention, through torch's own templated forward/backward",
         reader="torch.distributed.tensor.experimental._context_parallel._attention._enable_cp_dtensor_dispatcher"),
    # TRL (group "trl", installed when trl is imported: importing it costs seconds, so not before).
    Seam("trl.models.utils.prepare_fsdp", PATCHED, "integrations/trl.py",
         "TRL shards reference, teacher and reward models with one fully_shard at the root (a whole-model "
         "all-gather per forward): hf_fsdp2 shards them per layer, frozen, in the policy's settings",
         rebind_prefix="trl."),
    Seam("trl.generation.vllm_generation.VLLMGeneration._iter_named_params", PATCHED, "integrations/trl.py",
         "vLLM weight sync: TRL calls full_tensor() on each parameter (packed 4-bit rows, PEFT names); a model "
         "hf_fsdp2 sharded gives its weights as saved (adapters merged, 4-bit dequantized), one at a time",
         where_present=True),
    # bitsandbytes.
    Seam("bitsandbytes.nn.modules.Linear4bit.forward", CLASS_SWAPPED, "quantization/bnb_4bit.py",
         "a sharded 4-bit layer dequantizes its gathered packed rows itself (bitsandbytes' forward "
         "expects its own Params4bit and QuantState)"),
    Seam("bitsandbytes.optim.optimizer.Optimizer8bit.step", CLASS_SWAPPED, "quantization/bnb_optimizers.py",
         "8-bit optimizers (adamw_8bit, paged_adamw_8bit) step on each rank's rows: the step calls our "
         "init_state/update_step, which hand bitsandbytes the local rows, gradient and state"),
)
_BY_TARGET = {seam.target: seam for seam in SEAMS}

# target -> (owner, name, original, replacement, group), in installation order
_installed: dict[str, tuple[Any, str, Any, Any, str]] = {}


def seam(target: str) -> Seam:
    """The declared seam for `target`; an undeclared target is a programming error."""
    if target not in _BY_TARGET:
        raise AssertionError(f"{target} is not declared in hf_fsdp2/runtime/upstream.py SEAMS")
    return _BY_TARGET[target]


def present(target: str) -> bool:
    """Whether the upstream code at `target` exists in the installed versions."""
    try:
        lookup(target)
    except (ImportError, AttributeError):
        return False
    return True


def resolve(target: str) -> tuple[Any, str]:
    """'pkg.module.Class.attr' -> (the object holding the attribute, 'attr'): the longest importable
    module prefix, then attributes."""
    parts = target.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:-1]:
            owner = getattr(owner, part)
        return owner, parts[-1]
    raise ImportError(f"cannot import any module of {target}")


def lookup(target: str) -> Any:
    """The upstream object now at `target` (ours while patched)."""
    owner, name = resolve(target)
    return getattr(owner, name)


def replace(target: str, replacement: Any, group: str) -> None:
    """Install `replacement` at the PATCHED `target` as part of `group` (idempotent per target)."""
    if seam(target).how != PATCHED:
        raise AssertionError(f"{target} is declared {seam(target).how}, not {PATCHED}")
    if target in _installed:
        return
    owner, name = resolve(target)
    # A class's own classmethod is kept as the descriptor (getattr would bind it to `owner`, and putting
    # that back would make subclasses call it with `owner` as cls).
    previous = vars(owner).get(name) if isinstance(vars(owner).get(name), classmethod) else getattr(owner, name)
    _installed[target] = (owner, name, previous, replacement, group)
    setattr(owner, name, replacement)
    _rebind(target, previous, replacement)


def _rebind(target: str, old: Any, new: Any) -> None:
    """Where the seam says so, every loaded module under its prefix that holds `old` under the
    target's name gets `new` (modules imported later import the patched name by themselves)."""
    prefix = seam(target).rebind_prefix
    if prefix is None:
        return
    name = target.rsplit(".", 1)[1]
    for module_name, module in list(sys.modules.items()):
        if module_name.startswith(prefix) and module is not None and module.__dict__.get(name) is old:
            setattr(module, name, new)


def installed(group: str | None = None) -> list[str]:
    return [t for t, entry in _installed.items() if group is None or entry[4] == group]


def installed_replacement(target: str) -> Any:
    """What we put at an installed PATCHED `target`."""
    return _installed[target][3]


# Our replacements also put on a reloaded module's new class of a patched name (`importlib.reload` of
# transformers.trainer): (group, class, name, the class's own attribute before, or None).
_reinstalled: list[tuple[str, type, str, Any]] = []


def reinstall_on(target: str, cls: type) -> bool:
    """Our replacement at the installed PATCHED `target` also on `cls`, a reloaded module's new class that
    `target`'s owner was; taken off with its group at `restore`. False when `cls` has it already."""
    _, name, _, ours, group = _installed[target]
    if vars(cls).get(name) is ours:
        return False
    _reinstalled.append((group, cls, name, vars(cls).get(name)))
    setattr(cls, name, ours)
    return True


def original(target: str, cls: type | None = None) -> Any:
    """The upstream function a PATCHED `target` held before we replaced it (a classmethod bound to `cls`,
    by default to the class that holds it)."""
    if target not in _installed:
        raise AssertionError(f"{target} is not patched")
    owner, _, previous, _, _ = _installed[target]
    return previous.__get__(None, cls or owner) if isinstance(previous, classmethod) else previous


def restore(group: str) -> None:
    """Put back every attribute of `group`, last installed first (reloaded classes' too)."""
    for entry in [e for e in reversed(_reinstalled) if e[0] == group]:
        _, cls, name, previous = entry
        if previous is None:
            delattr(cls, name)
        else:
            setattr(cls, name, previous)
        _reinstalled.remove(entry)
    for target in reversed(installed(group)):
        owner, name, previous, ours, _ = _installed.pop(target)
        setattr(owner, name, previous)
        _rebind(target, ours, previous)


def foreign(group: str) -> list[tuple[str, Any]]:
    """(target, what it holds now) for each of `group`'s targets that someone rebound after us."""
    out = []
    for target in installed(group):
        owner, name, _, ours, _ = _installed[target]
        current = vars(owner).get(name) if isinstance(ours, classmethod) else getattr(owner, name)
        if current is not ours:
            out.append((target, current))
    return out


def reinstate(target: str) -> None:
    """Put our replacement back at `target` (after `foreign` found it rebound)."""
    owner, name, _, ours, _ = _installed[target]
    setattr(owner, name, ours)


@contextlib.contextmanager
def scoped(target: str, make_replacement: Callable[[Any], Any]) -> Iterator[None]:
    """Inside the block, the SCOPED `target` holds `make_replacement(original)`."""
    if seam(target).how != SCOPED:
        raise AssertionError(f"{target} is declared {seam(target).how}, not {SCOPED}")
    owner, name = resolve(target)
    previous = getattr(owner, name)
    setattr(owner, name, make_replacement(previous))
    try:
        yield
    finally:
        setattr(owner, name, previous)


def set_class(obj: Any, cls: type, target: str) -> None:
    """`obj.__class__ = cls` for the CLASS_SWAPPED seam `target` (a subclass of obj's class, or back
    to one of its bases)."""
    if seam(target).how != CLASS_SWAPPED:
        raise AssertionError(f"{target} is declared {seam(target).how}, not {CLASS_SWAPPED}")
    if not (issubclass(cls, type(obj)) or issubclass(type(obj), cls)):
        raise AssertionError(f"{cls.__name__} is not a subclass or base of {type(obj).__name__}")
    obj.__class__ = cls


def wrap_instance_method(obj: Any, name: str, target: str, make_wrapper: Callable[[Any], Any]) -> None:
    """`obj.name` becomes `make_wrapper(bound original)` on this object only (idempotent)."""
    if seam(target).how != INSTANCE_WRAPPED:
        raise AssertionError(f"{target} is declared {seam(target).how}, not {INSTANCE_WRAPPED}")
    if getattr(obj.__dict__.get(name), "_hf_fsdp2_seam", None) == target:
        return
    wrapper = make_wrapper(getattr(obj, name))
    wrapper._hf_fsdp2_seam = target
    object.__setattr__(obj, name, wrapper)  # the instance's __dict__; nn.Module.__setattr__ is for tensors/modules


def add_entries(target: str, entries: dict) -> None:
    """Add `entries` to the REGISTERED dict at `target` (idempotent; an entry upstream already has is
    left alone: upstream's own handler wins)."""
    if seam(target).how != REGISTERED:
        raise AssertionError(f"{target} is declared {seam(target).how}, not {REGISTERED}")
    registry = lookup(target)
    for key, value in entries.items():
        registry.setdefault(key, value)


def subclass_base(target: str) -> type:
    """The private upstream class a SUBCLASSED seam extends ('...Class.method' -> Class)."""
    if seam(target).how != SUBCLASSED:
        raise AssertionError(f"{target} is declared {seam(target).how}, not {SUBCLASSED}")
    owner, _ = resolve(target)
    return owner
