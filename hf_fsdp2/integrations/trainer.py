"""The Transformers Trainer side: gather-free `save_model`, checkpoints and resume through hf_fsdp2.

The Trainer builds its Accelerator from `--fsdp` / `--fsdp_config`, so once the Accelerate backend
is registered the model is sharded by hf_fsdp2. What remains Trainer-specific is saving and
resuming: with FSDP the Trainer writes no weights under SHARDED_STATE_DICT and gathers the whole
model onto rank 0 under FULL_STATE_DICT, and its checkpoints hold pickles (optimizer.pt,
rng_state_N.pth). These `Trainer` methods are replaced while registered, only for models that
hf_fsdp2 sharded; everything else goes to the original.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

from ..checkpoint import async_save
from ..checkpoint.pretrained import load_pretrained, save_pretrained
from ..checkpoint.state import MANIFEST, load_rng_state, load_state, save_state
from ..runtime import import_hooks, upstream
from ..sharding import is_sharded, record_of

GROUP = "trainer"
logger = logging.getLogger(__name__)


def _original(name: str):
    target = f"transformers.{name}" if "." in name else f"transformers.Trainer.{name}"
    return upstream.original(target)


# Installed when the script imports them (runtime/import_hooks.py): a script that never uses the
# Trainer does not pay their import (about 2 s per process).
TRAINING_ARGS_MODULE, TRAINER_MODULE = "transformers.training_args", "transformers.trainer"


def register() -> None:
    """Idempotent. The replaced names are declared in runtime/upstream.py."""
    import_hooks.when_imported(TRAINING_ARGS_MODULE, _install_training_arguments)
    import_hooks.when_imported(TRAINER_MODULE, _install_trainer)
    for module in (TRAINING_ARGS_MODULE, TRAINER_MODULE):
        import_hooks.after_every_execution(module, functools.partial(_reinstall_after_reload, module))


def _reinstall_after_reload(module_name: str) -> None:
    """`importlib.reload(transformers.trainer)` defines a new Trainer class in the module, without our methods
    (`transformers.Trainer` keeps naming the patched one: the lazy package caches it): the same replacements
    go on the new class too, taken off at unregister (upstream.reinstall_on). On the first import this finds
    them there already."""
    import sys

    cls_name = "Trainer" if module_name == TRAINER_MODULE else "TrainingArguments"
    cls = getattr(sys.modules.get(module_name), cls_name, None)
    if cls is None:
        return
    for target in upstream.installed(GROUP):
        if target.startswith(f"transformers.{cls_name}."):
            upstream.reinstall_on(target, cls)


def _install_training_arguments() -> None:
    try:
        from transformers import TrainingArguments
    except ImportError:  # transformers without torch/accelerate extras: nothing to patch
        return
    upstream.replace("transformers.TrainingArguments.__post_init__",
                     functools.wraps(TrainingArguments.__post_init__)(_post_init), GROUP)


def _install_trainer() -> None:
    try:
        from transformers import Trainer
    except ImportError:
        return
    replacements = {"save_model": _save_model, "_save_checkpoint": _save_checkpoint,
                    "_load_from_checkpoint": _load_from_checkpoint,
                    "_load_optimizer_and_scheduler": _load_optimizer_and_scheduler,
                    "_load_rng_state": _load_rng_state, "_load_scaler": _load_scaler,
                    "_load_best_model": _load_best_model,
                    "get_total_train_batch_size": _get_total_train_batch_size}
    for name, replacement in replacements.items():
        upstream.replace(f"transformers.Trainer.{name}", functools.wraps(getattr(Trainer, name))(replacement),
                         GROUP)


def unregister() -> None:
    import_hooks.cancel(TRAINING_ARGS_MODULE)
    import_hooks.cancel(TRAINER_MODULE)
    for module in (TRAINING_ARGS_MODULE, TRAINER_MODULE):
        import_hooks.stop_watching(module)
    upstream.restore(GROUP)


def wants_fsdp(args) -> bool:
    """FSDP asked for by the Trainer's own flag (`--fsdp`) or by `accelerate launch` with an FSDP
    config, which sets ACCELERATE_USE_FSDP=true (accelerate/commands/launch.py) and no flag."""
    return bool(args.fsdp) or os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true"


def _post_init(self):
    """TrainingArguments.__post_init__: on a machine without GPUs, FSDP runs on CPU processes (gloo).

    Without `use_cpu`, PartialState finds no device and picks DistributedType.NO: each process then
    trains its own unsharded copy, silently (under `accelerate launch`), or the Trainer refuses FSDP
    (under `--fsdp`); and `bf16=True` fails the Trainer's GPU check. Set here, before those checks,
    `use_cpu` starts gloo (what `--use_cpu` would do); the Accelerate backend then turns the
    MULTI_CPU state into FSDP, and bf16 runs as CPU autocast.
    """
    import torch

    if wants_fsdp(self) and not self.use_cpu and not torch.cuda.is_available():
        from accelerate.utils import is_xpu_available

        if not is_xpu_available():
            self.use_cpu = True
    return _original("TrainingArguments.__post_init__")(self)


def _get_total_train_batch_size(self, args) -> int:
    """Trainer.get_total_train_batch_size, divided by the ranks that share rows under hf_fsdp2's Ulysses.

    The Trainer counts world size / (its tp, cp and Accelerate's own sp_size) data-parallel ranks; under
    hf_fsdp2's sp_size (HF_FSDP2_SP_SIZE / register(sp_size=...), with its cp_size: sp x cp ranks; settings
    Accelerate does not see) the ranks of such a group load the same rows (integrations/accelerate.py's prepared
    data loader), so they count once: without this the total batch size it logs, its sample count under max_steps
    and `train_samples_per_second` are that many times too high. This changes what the Trainer's own method
    returns: logged where it happens."""
    from .accelerate import ranks_sharing_rows

    total = _original("get_total_train_batch_size")(self, args)
    shared = ranks_sharing_rows(self.accelerator)
    if shared == 1:
        return total
    logger.warning(f"hf_fsdp2: the Trainer's total train batch size {total} divided by {shared}, the ranks of each "
                   f"hf_fsdp2 sequence-parallel group (sp_size, x cp_size), which load the same rows: {total // shared}")
    return total // shared


def _ours(trainer) -> bool:
    return is_sharded(trainer.model)


def _extra_files(trainer, with_state: bool):
    """Files that commit together with the weights: tokenizer/processor, args, Trainer state (rank 0)."""
    def write(directory: Path) -> None:
        if trainer.processing_class is not None:
            trainer.processing_class.save_pretrained(str(directory))
        (directory / "training_args.json").write_text(trainer.args.to_json_string())
        if with_state:
            trainer.state.save_to_json(str(directory / "trainer_state.json"))
    return write


def _save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
    if not _ours(self):
        return _original("save_model")(self, output_dir, _internal_call)
    output_dir = output_dir if output_dir is not None else self.args.output_dir
    save_pretrained(self.model, output_dir, write_extra=_extra_files(self, with_state=False))
    if self.args.push_to_hub and not _internal_call:
        self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)


def _save_checkpoint(self, model, trial) -> None:
    """One atomic directory per checkpoint: weights (HF/PEFT layout), optimizer, scheduler, RNG,
    trainer_state.json, tokenizer. Mirrors Trainer._save_checkpoint's bookkeeping."""
    if not _ours(self):
        return _original("_save_checkpoint")(self, model, trial)
    from transformers.trainer_callback import ExportableState
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    async_save.wait_pending()  # the previous checkpoint is on disk before the best one is looked for
    if self.hp_search_backend is None and trial is None:
        self.store_flos()
    run_dir = self._get_output_dir(trial=trial)
    output_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
    if self.state.best_global_step:
        # Stock sets this after writing the weights, so the best may be this very checkpoint; here the
        # checkpoint commits as a whole, with trainer_state.json inside, so decide it first.
        best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}")
        if self.state.best_global_step == self.state.global_step or os.path.exists(best):
            self.state.best_model_checkpoint = best
    for cb in [c for c in self.callback_handler.callbacks + [self.control] if isinstance(c, ExportableState)]:
        name = cb.__class__.__name__
        if isinstance(self.state.stateful_callbacks.get(name), list):
            self.state.stateful_callbacks[name].append(cb.state())
        else:
            self.state.stateful_callbacks[name] = cb.state()
    from transformers.trainer_utils import rotate_checkpoints

    should_save, limit, best = self.args.should_save, self.args.save_total_limit, self.state.best_model_checkpoint

    def rotate() -> None:  # on rank 0 after the commit: an asynchronous checkpoint is not on disk at return
        if should_save:
            rotate_checkpoints(output_dir=run_dir, save_total_limit=limit, best_model_checkpoint=best, use_mtime=True)

    # The last checkpoint of the run is saved blocking: nothing is left to overlap, and the Trainer's
    # end-of-training bookkeeping (best model, deleting checkpoints over the limit) must see it.
    blocking = not record_of(self.model).config.async_save or self.state.global_step >= self.state.max_steps
    if self.args.save_only_model:  # the weights and trainer_state.json; nothing to resume training from
        save_pretrained(self.model, output_dir, write_extra=_extra_files(self, with_state=True),
                        blocking=blocking, after_commit=rotate)
    else:
        save_state(output_dir, self.model, self.optimizer, self.lr_scheduler, step=self.state.global_step,
                   write_extra=_extra_files(self, with_state=True), blocking=blocking, after_commit=rotate)


def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
    if not _ours(self):
        return _original("_load_from_checkpoint")(self, resume_from_checkpoint, model)
    load_pretrained(self.model, resume_from_checkpoint)


def _refuse_partial_resume(checkpoint: str | None) -> None:
    """A checkpoint of ours holds optimizer, scheduler and RNG state that only hf_fsdp2 reads; the
    stock Trainer would find no optimizer.pt / rng_state.pth and go on without them, silently."""
    if checkpoint is not None and (Path(checkpoint) / MANIFEST).exists():
        raise RuntimeError(
            f"{checkpoint} was written by hf_fsdp2 (optimizer.safetensors, rng/, {MANIFEST}); this Trainer is "
            "not sharded by hf_fsdp2, so resuming would lose the optimizer, scheduler and RNG state. Resume "
            "with FSDP (hf_fsdp2.register() and --fsdp, or accelerate launch with an FSDP2 config), or load "
            "only the weights with from_pretrained and start a new run.")


def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
    if not _ours(self) or checkpoint is None:
        _refuse_partial_resume(checkpoint)
        return _original("_load_optimizer_and_scheduler")(self, checkpoint)
    if not (Path(checkpoint) / MANIFEST).exists() and (Path(checkpoint) / "trainer_state.json").exists():
        raise RuntimeError(f"{checkpoint} holds only the model (saved with `save_only_model=True`); there is "
                           "no optimizer, scheduler or RNG state to resume training from.")
    load_state(checkpoint, self.model, self.optimizer, self.lr_scheduler, load_weights=False)


def _load_best_model(self) -> None:
    """`load_best_model_at_end`: the best checkpoint is in our layout, not the DCP one stock FSDP looks for."""
    if not _ours(self):
        return _original("_load_best_model")(self)
    load_pretrained(self.model, self.state.best_model_checkpoint)


def _load_rng_state(self, checkpoint: str | None) -> None:
    if not _ours(self) or checkpoint is None:
        return _original("_load_rng_state")(self, checkpoint)
    load_rng_state(checkpoint)


def _load_scaler(self, checkpoint: str | None) -> None:
    if not _ours(self) or checkpoint is None:
        return _original("_load_scaler")(self, checkpoint)
    # No GradScaler state: FSDP2 mixed precision here is bf16 (no loss scaling) or fp32.
