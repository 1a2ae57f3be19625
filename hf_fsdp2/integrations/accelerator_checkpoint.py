"""Accelerate's checkpoint methods under hf_fsdp2: `Accelerator.save_model`, `save_state` and `load_state`
(replaced by the backend's `register()`, integrations/accelerate.py) write and read Hugging Face files and
hf_fsdp2's training state gather-free for a model hf_fsdp2 sharded (each rank its own rows, any mesh on
load); an accelerator with any other model goes to Accelerate's own. What Accelerate's own save_state adds
(schedulers, registered objects, dataloader epochs, its step) travels in the state's manifest as JSON."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..checkpoint import state
from ..checkpoint.errors import CheckpointError
from ..checkpoint.pretrained import save_pretrained
from ..runtime import upstream
from ..sharding import is_sharded, record_of


def _original(name: str):
    return upstream.original(f"accelerate.accelerator.Accelerator.{name}")


def is_ours(accelerator) -> bool:
    """The accelerator runs FSDP2 on a model hf_fsdp2 sharded."""
    return getattr(accelerator, "is_fsdp2", False) and any(
        is_sharded(m) for m in getattr(accelerator, "_models", []))


def save_model(self, model, save_directory, max_shard_size="10GB", safe_serialization=True):
    if not is_ours(self):
        return _original("save_model")(self, model, save_directory, max_shard_size,
                                                      safe_serialization)
    if not safe_serialization:
        raise ValueError("hf_fsdp2 writes safetensors only; `safe_serialization=False` is not supported.")
    save_pretrained(model, save_directory, max_shard_size=max_shard_size)


def _accelerate_extra(accelerator) -> dict:
    """What Accelerate's own save_state adds: schedulers, registered objects, dataloader epochs, step."""
    def as_json(obj, what):
        state = obj.state_dict()
        try:
            return json.loads(json.dumps(state))
        except TypeError as e:
            raise TypeError(f"{what} ({type(obj).__name__}).state_dict() is not JSON-serialisable ({e}); "
                            "hf_fsdp2 stores no pickles.") from None

    return {
        "accelerate": {
            "step": accelerator.step,
            "schedulers": [as_json(s, f"scheduler {i}") for i, s in enumerate(accelerator._schedulers)],
            "custom_objects": [as_json(o, f"registered object {i}") for i, o in enumerate(accelerator._custom_objects)],
            "dataloaders": [{"iteration": getattr(dl, "iteration", 0)} for dl in accelerator._dataloaders],
        }
    }


def save_state(self, output_dir=None, safe_serialization=True, **kwargs):
    if not is_ours(self):
        return _original("save_state")(self, output_dir, safe_serialization, **kwargs)
    config = self.project_configuration
    if config.automatic_checkpoint_naming:
        output_dir = os.path.join(self.project_dir, "checkpoints", f"checkpoint_{self.save_iteration}")
    if output_dir is None:
        raise ValueError("`output_dir` is required unless the ProjectConfiguration names checkpoints automatically.")
    model, optimizer = self._models[0], self._optimizers[0] if self._optimizers else None
    if optimizer is None:
        raise ValueError("hf_fsdp2's save_state needs the optimizer prepared with the model.")
    keep = config.total_limit if config.automatic_checkpoint_naming else None
    state.save_state(output_dir, model, optimizer, step=self.save_iteration, extra=_accelerate_extra(self),
                     keep_last=keep, blocking=not record_of(model).config.async_save)
    config.iteration += 1
    return output_dir


def load_state(self, input_dir=None, load_kwargs=None, **kwargs):
    if not is_ours(self):
        return _original("load_state")(self, input_dir, load_kwargs, **kwargs)
    if input_dir is None:
        if not self.project_configuration.automatic_checkpoint_naming:
            raise ValueError("`input_dir` is required unless the ProjectConfiguration names checkpoints "
                             "automatically.")
        input_dir = state.latest_state(Path(self.project_dir) / "checkpoints")
        if input_dir is None:
            raise FileNotFoundError(f"no complete checkpoint under {Path(self.project_dir) / 'checkpoints'}.")
    model, optimizer = self._models[0], self._optimizers[0]
    # Check what Accelerate adds before load_state changes anything.
    saved = state.read_manifest(input_dir)["extra"].get("accelerate", {})
    pairs = []
    for what, objs, states in (("schedulers", self._schedulers, saved.get("schedulers", [])),
                               ("registered objects", self._custom_objects, saved.get("custom_objects", []))):
        if not isinstance(states, list) or len(objs) != len(states) or not all(isinstance(s, dict) for s in states):
            count = len(states) if isinstance(states, list) else "malformed"
            raise CheckpointError(f"{Path(input_dir) / state.MANIFEST}: {count} {what} saved, {len(objs)} "
                                  "prepared/registered now.")
        pairs += zip(objs, states)
    step, _ = state.load_state(input_dir, model, optimizer)
    for obj, saved_state in pairs:
        obj.load_state_dict(saved_state)
    for dl, dl_state in zip(self._dataloaders, saved.get("dataloaders", [])):
        if hasattr(dl, "set_epoch"):
            dl.set_epoch(dl_state["iteration"])
        if hasattr(dl, "iteration"):
            dl.iteration = dl_state["iteration"]
    self.step = saved.get("step", 0)
    self.project_configuration.iteration = step + 1
    return None
