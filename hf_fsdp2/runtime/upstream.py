"""Every place hf_fsdp2 replaces or extends another library's code: one table, one mechanism.

`SEAMS` lists each one: the upstream target (import path, then attribute path), how we touch it, the
hf_fsdp2 module that does, and why. Nothing else in the package assigns to another library's
attributes, writes its private state or an instance `__dict__`, changes `sys.meta_path`, swaps an
object's class, or reads a private name of another library not listed in `PRIVATE`
(tests/test_upstream_contracts.py scans the source for each), so `SEAMS` and `PRIVATE` are the whole list. The same test records, per target, the signature and source hash of
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
- PRIVATE_STATE: an upstream object's private attribute, or an entry of its private dict, written in
  place (`set_state`, `set_entry`, `del_entry`). The contract: the name is still in the source of the
  class (or module) that owns it, and, where `reader` names the upstream code that relies on it, that
  code's signature and source hash.
- IMPORT_HOOK: a module whose loader our finder on `sys.meta_path` wraps for one execution
  (runtime/import_hooks.py; `add_finder`, `wrap_loader`, `unwrap_loader`). The contract: the module is
  still loaded by a loader with `exec_module`.

Besides the seams, `PRIVATE` lists every private name of another library that hf_fsdp2 reads or calls
without replacing it (a callable's signature is recorded per version in tests/private_contracts.json),
and hf_fsdp2's own `_hf_fsdp2*` attributes on upstream objects are set through `tag` (no upstream name
is touched). The test's scan fails on any private name of another library read outside this table,
and on any write to private state, `__dict__`, `sys.meta_path` or a class outside this module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import sys
import threading
from typing import Any, Callable, Iterator

PATCHED = "patched while installed"
SCOPED = "patched inside a with-block"
CLASS_SWAPPED = "instance class set to a subclass"
SUBCLASSED = "private class subclassed"
INSTANCE_WRAPPED = "method wrapped on one instance"
REGISTERED = "entries added to a registry"
PRIVATE_STATE = "private state written in place"
IMPORT_HOOK = "loader wrapped on import"


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
    # REGISTERED, PRIVATE_STATE: the upstream function that reads what we write; its contract is recorded.
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
    Seam("accelerate.accelerator.Accelerator._prepare_cp", INSTANCE_WRAPPED, "sharding/context_parallel.py",
         "the `_cp_context` it sets (torch's context_parallel on the cp mesh, what maybe_context_parallel enters) is "
         "wrapped on the prepared accelerator: a sequence length cp_size does not divide is refused by name (torch "
         "would split it unevenly and its ring attention would fail inside)"),
    Seam("accelerate.accelerator.Accelerator.prepare_data_loader", PATCHED, _ACC,
         "under hf_fsdp2's Ulysses (sp_size) the ranks of an sp group load the same rows (the prepared model's "
         "training forward splits them along the sequence): the loader is built for the data-parallel ranks only"),
    Seam("accelerate.accelerator.prepare_data_loader", SCOPED, _ACC,
         "inside Accelerator.prepare_data_loader under sp_size: num_processes / process_index of the data-parallel "
         "ranks (world / sp, rank // sp) and no mesh (Accelerate's mesh-based split knows tp and cp, not sp)"),
    Seam("accelerate.accelerator.Accelerator.gather_for_metrics", PATCHED, _ACC,
         "under hf_fsdp2's Ulysses the ranks of an sp group hold the same rows: the gathered metrics keep one rank "
         "of each sp group (else each row counts sp times and the last batch's remainder is cut wrong)"),
    Seam("accelerate.accelerator.Accelerator.gather", SCOPED, _ACC,
         "inside gather_for_metrics under sp_size: the gathered tensors keep the first rank of each sp group"),
    Seam("accelerate.accelerator.gather_object", SCOPED, _ACC,
         "inside gather_for_metrics under sp_size: the gathered objects of the first rank of each sp group"),
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
    Seam("transformers.Trainer.get_total_train_batch_size", PATCHED, _TR,
         "under hf_fsdp2's Ulysses (sp_size, which Accelerate's parallelism_config does not carry) the sp ranks "
         "sharing rows count once: divided by sp_size, logged where it happens"),
    # torch.
    Seam("torch.distributed.destroy_process_group", PATCHED, "checkpoint/async_save.py",
         "a background save still needs its agreement group: wait for it before the groups go"),
    Seam("torch.nn.utils.clip_grad_norm_", PATCHED, "sharding/grad_clip.py",
         "once a model is split by expert parallelism, a call on gradients of several device meshes (which torch "
         "cannot combine: a DTensor mesh error) is refused naming hf_fsdp2.clip_grad_norm_; every other call is "
         "torch's, unchanged (group \"grad-clip\")"),
    Seam("torch.nn.Module.register_parameter", SCOPED, "checkpoint/pretrained.py",
         "build a model with parameters on meta but real buffers (rotary inv_freq is not in checkpoints)"),
    Seam("torch.distributed.fsdp._fully_shard._fully_shard.fully_shard", CLASS_SWAPPED,
         "checkpoint/key_conversion.py",
         "fully_shard makes each module an FSDP<Name>(FSDPModule, Name); transformers finds weight "
         "conversions by class name, so the lookup is shown the original classes"),
    Seam("torch.distributed._composable.replicate.replicate", CLASS_SWAPPED, "checkpoint/key_conversion.py",
         "replicate (shard size 1, sharding/replication.py) makes the model a DDP<Name>(DDP, Name); as for "
         "fully_shard, transformers' conversion lookup is shown the original class"),
    Seam("torch.nn.Module.__getattr__", CLASS_SWAPPED, "sharding/compile/compiled_collectives.py",
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
    Seam("peft.tuners.lora.layer.ParamWrapper.forward", INSTANCE_WRAPPED,
         "sharding/expert_parallel/lora.py, sharding/expert_parallel/grouped.py",
         "LoRA on experts transformers split over ranks (ep_size > 1): PEFT's parametrization would fold every "
         "expert's delta into weights that are each rank's rows; the wrapper calls the experts, which add their own. "
         "Whole experts (ep_size 1) on transformers' grouped_mm: the adapters inside the grouped matmuls, no fold"),
    Seam("transformers.integrations.moe.grouped_mm_experts_forward", INSTANCE_WRAPPED,
         "sharding/expert_parallel/low_precision.py",
         "fp8_experts without EP (ep_size 1): the experts' forward is its steps (sharding/expert_parallel/grouped.py) "
         "with torchao's FP8 grouped matmuls in place of transformers' _grouped_mm, which has no matmul to hand in"),
    Seam("transformers.distributed.expert_parallel.EpDispatchExpertsParallel.install_forward", INSTANCE_WRAPPED,
         "sharding/expert_parallel/lora.py",
         "the EP forward that transformers installs on split experts runs, with LoRA, on each rank's rows plus the "
         "delta of those experts only", where_present=True),
    Seam("peft.tuners.tuners_utils.BaseTuner.merge_and_unload", INSTANCE_WRAPPED, "sharding/expert_parallel/lora.py",
         "on a model whose split experts (ep_size > 1) carry LoRA, refused by name before PEFT merges a module: "
         "each rank holds only its experts' rows (save_pretrained(merge_adapters=True) writes the merged model)"),
    Seam("peft.tuners.tuners_utils.BaseTuner.merge_adapter", INSTANCE_WRAPPED, "sharding/expert_parallel/lora.py",
         "the same for merge_adapter()"),
    Seam("transformers.generation.utils.GenerationMixin.generate", INSTANCE_WRAPPED, "sharding/generation.py",
         "on a model hf_fsdp2 sharded, each group is gathered once per generate() call, not once per token"),
    Seam("torch.distributed.tensor.experimental._context_parallel._attention.custom_ops", REGISTERED,
         "sharding/context_parallel.py",
         "torch's ring attention (context parallelism) handles the CUDA SDPA kernels only; the CPU flash kernel "
         "gets the same ring attention, through torch's own templated forward/backward",
         reader="torch.distributed.tensor.experimental._context_parallel._attention._enable_cp_dtensor_dispatcher"),
    Seam("transformers.distributed.expert_parallel.EPImplementationInterface._global_mapping", REGISTERED,
         "sharding/expert_parallel/dispatch.py",
         "expert parallelism's token dispatch without a host read per layer (even all-to-alls), registered as "
         "transformers documents (`EPImplementationInterface.register`) and named in apply_expert_parallelism",
         where_present=True,
         reader="transformers.distributed.expert_parallel.EpDispatchExpertsParallel.install_forward"),
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
    # Private state written in place (PRIVATE_STATE).
    Seam("torch.nn.Module._parameters", PRIVATE_STATE,
         "sharding/engine.py, checkpoint/loading.py, checkpoint/pretrained.py, quantization/bnb_4bit.py, "
         "sharding/expert_parallel/lora.py",
         "a registered parameter swapped in place, without register_parameter's checks: tied weights tied again, "
         "meta copies before loading, a 4-bit weight replaced by its packed rows, split experts' rows plus their "
         "LoRA delta for one forward"),
    Seam("torch.nn.Module.__dict__", PRIVATE_STATE, "sharding/compute_cast.py",
         "a parameter shadowed for one forward by an instance-dict entry of the same name (its cast copy): "
         "attribute lookup finds it before nn.Module.__getattr__ reads _parameters",
         reader="torch.nn.Module.__getattr__"),
    Seam("torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState._auto_reshard_after_forward", PRIVATE_STATE,
         "sharding/generation.py",
         "generate() keeps groups unsharded between tokens; the root's automatic choice is put back after"),
    Seam("torch.distributed.fsdp._fully_shard._fsdp_param_group.FSDPParamGroup.post_forward_mesh_info",
         PRIVATE_STATE, "sharding/generation.py",
         "each group's reshard-after-forward setting, put back after generate() (set_reshard_after_forward "
         "overwrites it)"),
    Seam("torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState._pre_forward_hook_handle", PRIVATE_STATE,
         "sharding/generation.py",
         "during generate() FSDP2's forward hooks are replaced at their key in the module's hook dicts by hooks "
         "that only cast (nothing to gather per token), then put back"),
    Seam("torch.distributed._composable.replicate._ReplicateState._init_kwargs", PRIVATE_STATE,
         "sharding/replication.py",
         "DDP's reducer is built at a point every rank reaches; whether it broadcasts rank 0's values is ours"),
    Seam("accelerate.state.PartialState._shared_state", PRIVATE_STATE, _ACC,
         "CPU-only FSDP: AcceleratorState mirrors its type into PartialState's shared state at the end of "
         "__init__, so the switch from MULTI_CPU to FSDP is written there too"),
    Seam("accelerate.state.AcceleratorState.distributed_type", PRIVATE_STATE, _ACC,
         "CPU-only FSDP: the MULTI_CPU state Accelerator.__init__ built becomes FSDP"),
    Seam("accelerate.state.AcceleratorState.fsdp_plugin", PRIVATE_STATE, _ACC,
         "CPU-only FSDP: the state gets the plugin Accelerate would have set for a device"),
    Seam("accelerate.utils.dataclasses.FullyShardedDataParallelPlugin.transformer_cls_names_to_wrap",
         PRIVATE_STATE, _ACC,
         "layer names normalised before Accelerate resolves them (a yaml list string; a PEFT model's base "
         "_no_split_modules)"),
    # Import hooks (IMPORT_HOOK): the modules whose loader runtime/import_hooks.py wraps, so the Trainer's seams
    # are installed when the script imports them (importing the Trainer costs ~2 s a process).
    # hf-fsdp2 run's start-up switch (startup/sitecustomize.py) wraps them too, and accelerate's, transformers'
    # modeling_utils' and TRL's models.utils: register() runs once the outermost of these imports has completed.
    Seam("transformers.training_args", IMPORT_HOOK, "runtime/import_hooks.py, startup/sitecustomize.py",
         "TrainingArguments' seam installed once the script imports it (integrations/trainer.py)"),
    Seam("transformers.trainer", IMPORT_HOOK, "runtime/import_hooks.py, startup/sitecustomize.py",
         "the Trainer's seams installed once the script imports it, and again after importlib.reload"),
    Seam("accelerate", IMPORT_HOOK, "startup/sitecustomize.py",
         "hf-fsdp2 run: register() once the process has imported Accelerate, not at start-up"),
    Seam("transformers.modeling_utils", IMPORT_HOOK, "startup/sitecustomize.py",
         "hf-fsdp2 run: register() patches its from_pretrained, so it waits for this import to complete"),
    Seam("trl.models.utils", IMPORT_HOOK, "startup/sitecustomize.py",
         "hf-fsdp2 run: register() patches its prepare_fsdp, so it waits for this import (which imports accelerate) "
         "to complete"),
)
_BY_TARGET = {seam.target: seam for seam in SEAMS}


@dataclasses.dataclass(frozen=True)
class Private:
    """A private name of another library that hf_fsdp2 reads or calls without replacing it."""
    module: str
    path: str  # attribute path inside `module`
    user: str  # the hf_fsdp2 module(s) that read it
    # The oldest (major, minor) of the module's package that has it, where hf_fsdp2 branches on it.
    since: tuple[int, int] | None = None
    # Set on instances by the owning class's code, not a class attribute: the contract is its name in that source.
    instance: bool = False
    # hf_fsdp2 copes without it (getattr with a default): checked only where present.
    optional: bool = False

    @property
    def name(self) -> str:
        return f"{self.module}.{self.path}"


_FS = "torch.distributed.fsdp._fully_shard"
_CP = "torch.distributed.tensor.experimental._context_parallel._attention"
_CC = "sharding/compile/compiled_collectives.py"
_GEN = "sharding/generation.py"
_REP = "sharding/replication.py"
_FST = "runtime/fsdp_state.py"
_CW = "torch.distributed.algorithms._checkpoint.checkpoint_wrapper"
PRIVATE: tuple[Private, ...] = (
    # torch: process groups and meshes.
    Private("torch.distributed.distributed_c10d", "_get_default_group", "runtime/collectives.py"),
    Private("torch.distributed.distributed_c10d", "ProcessGroup._device_types", "runtime/collectives.py"),
    Private("torch.distributed.distributed_c10d", "ProcessGroup._get_backend", "runtime/collectives.py"),
    Private("torch.distributed", "ProcessGroupGloo._Options._timeout", "runtime/collectives.py", optional=True),
    Private("torch.distributed.device_mesh", "DeviceMesh._flatten", "runtime/distributed.py"),
    # the memory estimate's shapes-only stand-in intercepts it where F.grouped_mm is absent (MoE layers)
    Private("torch", "_grouped_mm", "planner/activation_trace.py", optional=True),
    Private("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset", "checkpoint/tensor_export.py"),
    Private("transformers.distributed.parallel_utils", "_get_parameter_plan", "sharding/expert_parallel/lora.py",
            since=(5, 23)),  # with transformers' EP (sharding/expert_parallel/ require_available)
    Private("torch.distributed.tensor.placement_types", "_StridedShard", "checkpoint/tensor_export.py"),
    Private("torch.distributed.checkpoint.filesystem", "_StorageInfo", "checkpoint/convert.py"),
    # torch: a tensor's version counter (bumped by every in-place op, on meta too): a deferred model's lost change
    Private("torch", "Tensor._version", "integrations/deferred_load.py"),
    # torch: nn.Module internals.
    Private("torch.nn", "Module._parameters", f"sharding/engine.py, {_CC}, checkpoint/loading.py, "
            "checkpoint/pretrained.py, quantization/bnb_4bit.py, sharding/expert_parallel/lora.py", instance=True),
    Private("torch.nn", "Module._forward_pre_hooks", f"{_GEN}, {_REP}", instance=True),
    Private("torch.nn", "Module._non_persistent_buffers_set", "checkpoint/tensor_export.py", instance=True),
    Private("torch.nn", "Module._compiled_call_impl", "sharding/compile/__init__.py"),
    Private(_CW, "CheckpointWrapper._checkpoint_wrapped_module", "sharding/compute_cast.py, sharding/groups.py, "
            "sharding/engine.py, planner/layout.py", instance=True),
    # torch: FSDP2 internals.
    Private(f"{_FS}._fsdp_collectives", "foreach_all_gather", "quantization/fp8.py"),
    Private("torch.distributed.fsdp", "FSDPModule._get_fsdp_state", f"{_GEN}, quantization/fp8.py"),
    Private("torch.distributed.fsdp", "FSDPModule._set_unshard_async_op", "sharding/engine.py", optional=True),
    Private(f"{_FS}._fsdp_state", "FSDPState._lazy_init", _GEN),
    Private(f"{_FS}._fsdp_state", "FSDPState._modules", _GEN, instance=True),
    Private(f"{_FS}._fsdp_state", "FSDPState._mp_policy", f"{_FST}, {_GEN}", instance=True),
    Private(f"{_FS}._fsdp_state", "FSDPState._post_forward_hook_handle", _GEN, instance=True),
    Private(f"{_FS}._fsdp_state", "FSDPState._fsdp_param_group", _FST, instance=True),
    Private(f"{_FS}._fsdp_state", "FSDPState._fsdp_param_groups", _FST, since=(2, 12), instance=True),
    Private(f"{_FS}._fsdp_param", "FSDPParam._orig_size", _GEN, instance=True),
    # runtime/fsdp_state.py: FSDP2's casts are methods from torch 2.13; before, its helpers are called directly.
    Private(f"{_FS}._fsdp_state", "FSDPState._cast_forward_inputs", _FST, since=(2, 13)),
    Private(f"{_FS}._fsdp_state", "FSDPState._cast_output_dtype", _FST, since=(2, 13)),
    Private(f"{_FS}._fsdp_common", "_cast_fp_tensor", _FST),
    Private("torch.distributed.utils", "_apply_to_tensors", _FST),
    # torch: context parallelism.
    Private(_CP, "_templated_ring_attention", "sharding/context_parallel.py"),
    Private(_CP, "_templated_ring_attention_backward", "sharding/context_parallel.py"),
    Private(_CP, "_cp_options", "sharding/context_parallel.py"),  # its enable_load_balance, read (ring with Ulysses)
    Private("torch.distributed.tensor", "DTensor._op_dispatcher._custom_op_handlers", "sharding/context_parallel.py"),
    Private("torch.distributed.tensor", "DTensor._op_dispatcher.unwrap_to_op_info", "sharding/context_parallel.py"),
    Private("torch.distributed.tensor._dtensor_spec", "TensorMeta", "sharding/context_parallel.py"),
    Private("torch.distributed.tensor._dtensor_spec", "DTensorSpec", "sharding/context_parallel.py"),
    Private("torch._ops", "OpOverload._schema", "sharding/context_parallel.py", instance=True),
    *[Private("torch", f"ops.aten.{op}", "sharding/context_parallel.py, sharding/selective_checkpoint.py") for op in (
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu")],
    Private("torch", "ops.aten._scaled_dot_product_flash_attention_for_cpu_backward", "sharding/context_parallel.py"),
    # sharding/selective_checkpoint.py: the fused attention kernels whose outputs it keeps (those this build has)
    *[Private("torch", f"ops.aten.{op}", "sharding/selective_checkpoint.py", optional=True) for op in (
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")],
    # sharding/context_parallel.py: the GPU kernel of its ring attention with Ulysses (on a CUDA build's ranks only)
    *[Private("torch", f"ops.aten.{op}", "sharding/context_parallel.py", optional=True) for op in (
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward")],
    Private("torch", "ops.aten._local_scalar_dense", "planner/activation_trace.py"),
    # torch: DDP (replicate).
    Private("torch.distributed._composable.replicate", "_ReplicateState.lazy_init", _REP),
    Private("torch.distributed._composable.replicate", "_ReplicateState._comm_hook_args", _REP, instance=True),
    Private("torch.distributed._composable.replicate", "_ReplicateState._ddp", _REP, instance=True),
    Private("torch.distributed._composable.replicate", "replicate", _REP),
    Private("torch.distributed._composable.replicate", "DDP", "checkpoint/key_conversion.py"),
    Private("torch.distributed._composable.contract", "_get_registry", _REP),
    Private("torch.nn.parallel", "DistributedDataParallel._active_ddp_module", _REP),
    Private("torch._C", "_current_graph_task_id", _REP),
    # torch: compilers and utilities.
    Private("torch._dynamo", "disable", f"{_CC}, sharding/compute_cast.py"),
    Private("torch._dynamo", "exc.Unsupported", _CC),
    *[Private("torch._functorch.config", name, _CC) for name in (
        "joint_custom_pass", "enable_autograd_cache", "enable_remote_autograd_cache")],
    *[Private("torch._inductor.config", name, _CC) for name in (
        "bucket_all_gathers_fx", "bucket_reduce_scatters_fx", "bucket_all_reduces_fx",
        "bucket_all_gathers_fx_bucket_size_determinator", "bucket_reduce_scatters_fx_bucket_size_determinator",
        "bucket_all_reduces_fx_bucket_size_determinator")],
    *[Private("torch._inductor.fx_passes.bucketing", name, _CC)
      for name in ("is_fsdp_all_gather", "is_wait_tensor", "is_all_gather_into_tensor")],
    Private("torch._inductor.compile_fx", "compile_fx", _CC),
    Private("torch.utils._ordered_set", "OrderedSet", _CC),  # is_fsdp_all_gather's ancestor sets on torch 2.11/2.12
    Private("torch.utils._python_dispatch", "TorchDispatchMode",
            "planner/activation_trace.py, tools/collective_tally.py, tools/simulate.py"),
    # hf-fsdp2 simulate (tools/): torch's fake process group, and a c10d op's group and name as the dispatcher hands them
    Private("torch.testing._internal.distributed.fake_pg", "FakeStore", "tools/simulate.py"),
    # ranks as threads (tools/local_ranks.py): torch's threaded process group, as its MultiThreadedTestCase runs it
    Private("torch.testing._internal.distributed.multi_threaded_pg", "ProcessLocalGroup", "tools/local_ranks.py"),
    Private("torch.testing._internal.distributed.multi_threaded_pg", "_install_threaded_pg", "tools/local_ranks.py"),
    Private("torch.testing._internal.distributed.multi_threaded_pg", "_uninstall_threaded_pg", "tools/local_ranks.py"),
    Private("torch._C._distributed_c10d", "_set_thread_isolation_mode", "tools/local_ranks.py"),
    Private("torch.distributed.distributed_c10d", "_world", "tools/local_ranks.py"),
    Private("torch._C._distributed_c10d", "_resolve_process_group", "tools/collective_tally.py"),
    Private("torch._ops", "OpOverload._opname", "tools/collective_tally.py", instance=True),
    # checkpoint/convert.py: globals its restricted unpickler lets DCP's .metadata name (pickle's find_class)
    Private("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING", "checkpoint/convert.py"),
    Private("torch.serialization", "_get_layout", "checkpoint/convert.py"),
    Private("torch.utils._pytree", "tree_leaves", "planner/activation_trace.py"),
    Private("torch.utils._pytree", "tree_map", "sharding/compute_cast.py"),
    *[Private(_CW, name, "sharding/engine.py, sharding/groups.py, sharding/compute_cast.py, planner/layout.py")
      for name in ("CheckpointWrapper", "CheckpointImpl", "checkpoint_wrapper")],
    # sharding/sequence_tiling.py's TiledMLP is an ActivationWrapper (its parameter and state-dict names unchanged)
    Private(_CW, "ActivationWrapper", "sharding/sequence_tiling.py"),
    Private(_CW, "ActivationWrapper._checkpoint_wrapped_module", "sharding/sequence_tiling.py", instance=True),
    # accelerate.
    *[Private("accelerate.accelerator", f"Accelerator.{name}", "integrations/accelerator_checkpoint.py", instance=True)
      for name in ("_models", "_optimizers", "_schedulers", "_custom_objects", "_dataloaders")],
    Private("accelerate.accelerator", "Accelerator._cp_context", "sharding/context_parallel.py", instance=True),
    # transformers.
    Private("transformers.modeling_utils", "PreTrainedModel._no_split_modules", f"{_ACC}, sharding/groups.py"),
    Private("transformers.modeling_utils", "PreTrainedModel._init_weights", "sharding/engine.py"),
    Private("transformers.modeling_utils", "PreTrainedModel._get_dtype_plan", "checkpoint/pretrained.py"),
    Private("transformers.modeling_utils", "PreTrainedModel._resolve_parallel_plans", "sharding/parallel_plans.py",
            optional=True),
    Private("transformers.modeling_utils", "PreTrainedModel._weight_conversions", "checkpoint/key_conversion.py",
            optional=True),
    Private("transformers.trainer", "Trainer._get_output_dir", _TR),
    # differentiable collectives of Ulysses and of the EP dispatch (torch.distributed.nn.functional's are deprecated)
    *[Private("torch.distributed._functional_collectives", name, "sharding/sequence_parallel.py")
      for name in ("all_reduce", "all_to_all_single_autograd", "all_gather_tensor_autograd")],
    *[Private("torch.distributed._functional_collectives", name, "sharding/expert_parallel/dispatch.py",
              optional=True)  # one pair or the other: torch 2.13's names, 2.11's
      for name in ("all_gather_single", "reduce_scatter_single", "all_gather_tensor_autograd",
                   "reduce_scatter_tensor_autograd")],
    # the EP dispatch's experts on rows it sorted itself: transformers' grouped matmul dispatcher and the experts'
    # gate (use_experts_implementation gives classes without their own gate integrations/moe.py's default)
    Private("transformers.integrations.moe", "_grouped_mm", "sharding/expert_parallel/dispatch.py"),
    *[Private(module, f"{cls}._apply_gate", "sharding/expert_parallel/dispatch.py")
      for module, cls in (("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeExperts"),
                          ("transformers.models.gpt_oss.modeling_gpt_oss", "GptOssExperts"))],
    # FSDP2Config.fp8_experts: torchao's MoE training grouped matmul (dynamic quantization, one config per mode), and
    # whether its build has the SM100 MXFP8 kernels (sharding/expert_parallel/low_precision.py)
    Private("torchao.prototype.moe_training.utils", "_quantize_then_scaled_grouped_mm",
            "sharding/expert_parallel/low_precision.py", since=(0, 17)),
    Private("torchao.prototype.moe_training.mxfp8_grouped_mm", "_SM100_KERNELS_AVAILABLE",
            "sharding/expert_parallel/low_precision.py", optional=True),
    # the implementation a model's attention looks up (Ulysses wraps it: sharding/sequence_parallel.py)
    Private("transformers.configuration_utils", "PreTrainedConfig._attn_implementation",
            "sharding/sequence_parallel.py"),
    Private("transformers.configuration_utils", "PreTrainedConfig._experts_implementation",
            "sharding/expert_parallel/dispatch.py, sharding/expert_parallel/grouped.py, "
            "sharding/expert_parallel/low_precision.py"),
    # A keyword the Auto classes may pass on, which from_pretrained reads: the contract is its name in that source
    # (integrations/deferred_load.py's _HUB_ONLY accepts it on the deferred path).
    Private("transformers.modeling_utils", "PreTrainedModel.from_pretrained._commit_hash",
            "integrations/deferred_load.py", instance=True),
    # peft.
    Private("peft.peft_model", "PeftModel._get_base_model_class", "sharding/model_parts.py"),
    Private("peft.tuners.lora.layer", "_ConvNd", "checkpoint/lora_merge.py"),
    Private("peft.tuners.lora.layer", "ParamWrapper._did_swap_in_out_features",
            "checkpoint/lora_merge.py, sharding/expert_parallel/lora.py",
            instance=True, optional=True),  # PEFT >= 0.19
    # bitsandbytes.
    Private("bitsandbytes.nn.modules", "_convert_weight_packed_for_cpu_inverse", "quantization/bnb_4bit.py"),
)

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


# SCOPED targets inside a block: target -> (the attribute before, {thread id: replacements, innermost last}).
_scopes: dict[str, tuple[Any, dict[int, list[Any]]]] = {}
_scopes_lock = threading.Lock()


@contextlib.contextmanager
def scoped(target: str, make_replacement: Callable[[Any], Any]) -> Iterator[None]:
    """Inside the block, the SCOPED `target` holds `make_replacement(original)` for the thread that opened it.

    Other threads meet the original meanwhile, and blocks of several threads may end in any order: ranks that
    are threads of one process (tools/local_ranks.py) build models at once, and one rank's block must neither
    reach another rank's parameters nor be left installed by the other's exit."""
    if seam(target).how != SCOPED:
        raise AssertionError(f"{target} is declared {seam(target).how}, not {SCOPED}")
    owner, name = resolve(target)
    me = threading.get_ident()
    with _scopes_lock:
        if target not in _scopes:
            per_thread: dict[int, list[Any]] = {}
            before = getattr(owner, name)

            @functools.wraps(before)
            def dispatch(*args, **kwargs):
                stack = per_thread.get(threading.get_ident())
                return (stack[-1] if stack else before)(*args, **kwargs)

            _scopes[target] = (before, per_thread)
            setattr(owner, name, dispatch)
        before, per_thread = _scopes[target]
        stack = per_thread.setdefault(me, [])
        stack.append(make_replacement(stack[-1] if stack else before))
    try:
        yield
    finally:
        with _scopes_lock:
            stack.pop()
            if not stack:
                del per_thread[me]
            if not per_thread:
                del _scopes[target]
                setattr(owner, name, before)


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


@functools.cache  # checked once per (target, name): compute_cast writes through set_entry on every forward
def _private_state(target: str, name: str) -> None:
    if seam(target).how != PRIVATE_STATE:
        raise AssertionError(f"{target} is declared {seam(target).how}, not {PRIVATE_STATE}")
    if target.rsplit(".", 1)[1] != name:
        raise AssertionError(f"{name} is not the attribute the seam {target} declares")


def set_state(obj: Any, name: str, value: Any, target: str) -> None:
    """`obj.name = value` for the PRIVATE_STATE seam `target` (whose last part is `name`)."""
    _private_state(target, name)
    setattr(obj, name, value)


def set_entry(obj: Any, name: str, key: Any, value: Any, target: str) -> None:
    """`obj.name[key] = value` (a private dict of an upstream object) for the PRIVATE_STATE seam `target`."""
    _private_state(target, name)
    getattr(obj, name)[key] = value


def del_entry(obj: Any, name: str, key: Any, target: str) -> None:
    """`obj.name.pop(key)` (absent is fine) for the PRIVATE_STATE seam `target`."""
    _private_state(target, name)
    getattr(obj, name).pop(key, None)


def set_item(mapping: dict, key: Any, value: Any, target: str) -> None:
    """`mapping[key] = value` for a dict of upstream state reached through the PRIVATE_STATE seam `target`
    (FSDP2's hook handles lead to the module's hook dicts)."""
    _private_state(target, target.rsplit(".", 1)[1])
    mapping[key] = value


def tag(obj: Any, name: str, value: Any) -> None:
    """hf_fsdp2's own attribute `name` (`_hf_fsdp2*`) on an upstream object, in its instance dict: no
    upstream name is touched, and nn.Module/dataclass __setattr__ logic is bypassed."""
    if not name.startswith("_hf_fsdp2"):
        raise AssertionError(f"{name}: hf_fsdp2's attributes on upstream objects are named _hf_fsdp2*")
    obj.__dict__[name] = value


def add_finder(finder: Any) -> None:
    """`finder` first on `sys.meta_path` (runtime/import_hooks.py; idempotent)."""
    if finder not in sys.meta_path:
        sys.meta_path.insert(0, finder)


def remove_finder(finder: Any) -> None:
    if finder in sys.meta_path:
        sys.meta_path.remove(finder)


def spec_from_other_finders(finder: Any, fullname: str, path: Any, target: Any = None) -> Any:
    """The spec the finders on `sys.meta_path` other than `finder` give for `fullname`, as the import system would
    without it (None when none finds it): what a watching finder wraps (runtime/import_hooks.py, startup/)."""
    for other in sys.meta_path:
        if other is finder or not hasattr(other, "find_spec"):
            continue
        spec = other.find_spec(fullname, path, target)
        if spec is not None:
            return spec
    return None


def wrap_loader(spec: Any, make_loader: Callable[[Any], Any]) -> None:
    """The IMPORT_HOOK module `spec.name` is loaded by `make_loader(its real loader)`."""
    if seam(spec.name).how != IMPORT_HOOK:
        raise AssertionError(f"{spec.name} is declared {seam(spec.name).how}, not {IMPORT_HOOK}")
    spec.loader = make_loader(spec.loader)


def unwrap_loader(module: Any, loader: Any) -> None:
    """The module's real `loader` back on it (`__loader__`, `__spec__.loader`) before its code runs."""
    module.__loader__ = loader
    if getattr(module, "__spec__", None) is not None:
        module.__spec__.loader = loader
