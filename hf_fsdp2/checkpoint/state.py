"""Training state checkpoints: model, optimizer, scheduler, RNG and a JSON manifest.

Everything is safetensors or JSON (no pickle). Tensors are written by rows exactly like
`save_pretrained`, keyed by global parameter names, so a state saved on N ranks loads on M ranks
(elastic resume): each rank reads the rows its new shard covers. A directory is committed
atomically and carries a completion marker; `load_state` refuses one without it.

Layout of a state directory:
    model.safetensors | adapter_model.safetensors (+ configs)   the weights, loadable by HF/PEFT
    optimizer.safetensors                                        "<param name>/<state key>" tensors
    hf_fsdp2_state.json                                          step, extra, param groups, scheduler
    rng/rank-00000.json ...                                      per-rank RNG states
    COMPLETE.json                                                written last
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from . import async_save
from .async_save import SaveHandle
from .atomic_dir import committed_directory, old_path, staging_path
from .export_plan import export_items
from .weights_io import ADAPTER_FILE, WeightsPlan, load_tensors, write_configs, write_tensors
from .safetensors_io import CheckpointError, CheckpointFiles, TensorSpec, read_json_file, write_json
from .tensor_export import ExportTensor, model_tensors
from ..quantization import bnb_optimizers
from ..sharding.model_parts import model_parts
from ..runtime import collectives

logger = logging.getLogger(__name__)
MODEL_ITEMS, OPTIMIZER_ITEMS = "state-model", "state-optimizer"  # kinds of staged tensors (async_save)
FORMAT = "hf_fsdp2.state/1"  # on-disk format id: never renamed with the module
MARKER = "COMPLETE.json"
MANIFEST = "hf_fsdp2_state.json"  # not trainer_state.json: the Trainer writes its own beside it
OPTIMIZER_FILE = "optimizer.safetensors"


# ---------------------------------------------------------------------------------------------
# Optimizer


def _param_names(model: nn.Module) -> dict[int, str]:
    return {id(t): name for name, t in model_tensors(model).items()}


def _optimizer_items(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[list[ExportTensor], dict, list]:
    """(tensor items, JSON-able non-tensor state, param groups with names instead of tensors)."""
    names = _param_names(model)
    items: list[ExportTensor] = []
    other: dict[str, dict[str, Any]] = {}
    groups = []
    for group in optimizer.param_groups:
        group_names = []
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError("the optimizer holds a parameter that is not in the model; build the optimizer "
                                 "from the sharded model's parameters (after `shard_model`).")
            group_names.append(names[id(p)])
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": group_names})
    for p, state in optimizer.state.items():
        name = names[id(p)]
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                items.append(ExportTensor(f"{name}/{key}", value, value.dtype))
            else:
                other.setdefault(name, {})[key] = value
    return items, other, groups


# State tensors torch's optimizers keep in the shape of their parameter (Adam(W), SGD, RMSprop, Adagrad,
# Adadelta, Adamax, NAdam, RAdam, ASGD); "step" is a scalar. Other keys are checked against a state
# the optimizer already holds, if any.
_PARAM_SHAPED = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "grad_avg", "sum",
                 "acc_delta", "exp_inf", "ax", "eta", "mu"}


def _compatible(saved: Any, current: Any) -> bool:
    """Whether a saved hyperparameter can stand in for the optimizer's current value."""
    if current is None or saved is None:
        return True
    if isinstance(current, bool) or isinstance(saved, bool):
        return isinstance(current, bool) and isinstance(saved, bool)
    if isinstance(current, (int, float)) or isinstance(current, torch.Tensor) and current.numel() == 1:
        return isinstance(saved, (int, float))
    if isinstance(current, (list, tuple)):
        return isinstance(saved, list) and len(saved) == len(current) and all(
            _compatible(a, b) for a, b in zip(saved, current))
    return isinstance(saved, type(current))


class OptimizerPlan:
    """The optimizer state of a checkpoint, checked against `optimizer` before anything changes:
    parameter names per group, hyperparameter types, and every state tensor's name, shape and dtype."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path, manifest: dict):
        where = directory / MANIFEST
        names = _param_names(model)
        saved_groups = manifest["param_groups"]
        if len(saved_groups) != len(optimizer.param_groups):
            raise CheckpointError(f"{where}: {len(saved_groups)} optimizer param groups saved, the "
                                  f"optimizer has {len(optimizer.param_groups)}.")
        self.by_name: dict[str, torch.Tensor] = {}
        for i, (saved, group) in enumerate(zip(saved_groups, optimizer.param_groups)):
            current = [names.get(id(p)) for p in group["params"]]
            if current != saved["params"]:
                diff = sorted(set(map(str, current)) ^ set(map(str, saved["params"])))
                raise CheckpointError(f"{where}: optimizer parameters differ from the checkpoint's: "
                                      f"{', '.join(diff[:10]) or 'their order'}.")
            for key, value in saved.items():
                if key != "params" and key in group and not _compatible(value, group[key]):
                    raise CheckpointError(f"{where}: param group {i}: {key}={value!r} cannot replace the "
                                          f"optimizer's {key}={group[key]!r} (another type).")
            self.by_name.update({names[id(p)]: p for p in group["params"]})
        for name, values in manifest["optimizer_state"].items():
            if name not in self.by_name or not isinstance(values, dict):
                raise CheckpointError(f"{where}: `optimizer_state` for unknown parameter {name!r}.")
        self.other = manifest["optimizer_state"]
        self.files = None
        if (directory / OPTIMIZER_FILE).exists() or (directory / (OPTIMIZER_FILE + ".index.json")).exists():
            self.files = CheckpointFiles(directory, OPTIMIZER_FILE)
        self.plan: dict[str, tuple[torch.Tensor, str, TensorSpec]] = {}
        for key in (self.files.names() if self.files is not None else []):
            name, _, state_key = key.rpartition("/")
            if name not in self.by_name:
                raise CheckpointError(f"{directory / OPTIMIZER_FILE}: state for unknown parameter {name!r}.")
            param, spec = self.by_name[name], self.files.spec(key)
            held = optimizer.state.get(param, {}).get(state_key)
            problem = None
            if state_key in _PARAM_SHAPED and (tuple(spec.shape) != tuple(param.shape)
                                               or not spec.dtype.is_floating_point):
                problem = f"{spec.dtype} {list(spec.shape)}, expected floating point {list(param.shape)}"
            elif state_key == "step" and spec.numel != 1:
                problem = f"shape {list(spec.shape)}, expected a scalar"
            elif isinstance(held, torch.Tensor) and (tuple(held.shape) != tuple(spec.shape) or held.dtype != spec.dtype):
                problem = f"{spec.dtype} {list(spec.shape)}, the optimizer holds {held.dtype} {list(held.shape)}"
            if problem:
                raise CheckpointError(f"{self.files.where[key]}: optimizer state {key!r}: {problem}.")
            self.plan[key] = (param, state_key, spec)

    def apply(self, optimizer: torch.optim.Optimizer, manifest: dict) -> None:
        for saved, group in zip(manifest["param_groups"], optimizer.param_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
        optimizer.state.clear()
        targets: dict[str, torch.Tensor] = {}
        for key, (param, state_key, spec) in self.plan.items():
            # States shaped like their parameter are sharded like it; others (Adam's step) are whole.
            like_param = tuple(spec.shape) == tuple(param.shape) and isinstance(param, DTensor)
            if bnb_optimizers.is_prepared(optimizer):  # its 8-bit states split by rows, the rest whole
                target = bnb_optimizers.empty_state(param, state_key, spec.dtype, tuple(spec.shape))
            elif like_param:
                target = torch.zeros_like(param, dtype=spec.dtype)
            else:
                target = torch.zeros(spec.shape, dtype=spec.dtype,
                                     device=param.device if not isinstance(param, DTensor) else "cpu")
            optimizer.state[param][state_key] = target
            targets[key] = target
        if self.files is not None:
            try:
                load_tensors(targets, self.files)
            finally:
                self.files.close()
        for name, values in self.other.items():
            optimizer.state[self.by_name[name]].update(values)


# ---------------------------------------------------------------------------------------------
# RNG


def _rng_state() -> dict[str, Any]:
    np_state = np.random.get_state(legacy=True)
    state = {
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def check_rng_state(state: Any, where: Path) -> None:
    """Refuse a malformed RNG state before anything is set: each part is tried on a throwaway generator."""
    try:
        if not isinstance(state, dict) or not {"python", "numpy", "torch"} <= state.keys():
            raise ValueError("needs `python`, `numpy` and `torch` states")
        version, internal, gauss = state["python"]
        random.Random().setstate((version, tuple(internal), gauss))
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.RandomState().set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
        if not isinstance(state["torch"], list) or len(state["torch"]) != len(torch.get_rng_state()):
            raise ValueError("`torch` is not a CPU generator state")
        torch.Generator().set_state(torch.tensor(state["torch"], dtype=torch.uint8))
    except (TypeError, ValueError, OverflowError, RuntimeError) as e:
        raise CheckpointError(f"{where}: not a valid RNG state ({e}).") from None


def _set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


# ---------------------------------------------------------------------------------------------


def _to_json(value: Any, what: str) -> Any:
    try:
        return json.loads(json.dumps(value))
    except TypeError as e:
        raise TypeError(f"{what} is not JSON-serialisable ({e}); hf_fsdp2 stores no pickles.") from None


def save_state(directory: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer,
               scheduler: Any = None, *, step: int, extra: dict | None = None, keep_last: int | None = None,
               write_extra: Callable[[Path], None] | None = None, progress: bool | None = None,
               durable: bool = True, blocking: bool = True,
               after_commit: Callable[[], None] | None = None) -> Path | SaveHandle:
    """Save model, optimizer, scheduler and RNG states to `directory`, committed atomically.

    `extra`: any JSON-serialisable dict, returned by `load_state`. `keep_last=N` deletes older
    complete states in the same parent directory, keeping the N with the highest step.
    `write_extra(staging_dir)`: runs on rank 0 to add files (a tokenizer, the Trainer's state) that
    must commit together with the checkpoint. `durable=False` skips the fsyncs (see `save_pretrained`).
    `blocking=False`: return a `SaveHandle` once this rank's rows are copied to host memory; writing
    and committing go on in the background (checkpoint/async_save.py). Any save first waits for the
    previous one. `after_commit()`: runs on rank 0 once the state is committed (in the background
    too), e.g. the Trainer's checkpoint rotation, which must not see an uncommitted checkpoint.
    Collective: call on every rank.
    """
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"`step`={step!r} must be a non-negative int.")
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"`keep_last`={keep_last!r} must be a positive int or None.")
    async_save.wait_pending()
    if not blocking and progress is None:
        progress = False  # no progress bar from the background in the middle of training's output
    directory = Path(directory).absolute()
    parts = model_parts(model)  # PEFT unwrapped once for the export and the configs
    adapter = parts.saved_adapter() if parts.has_peft else None  # what adapter_config.json is written from
    model_items, is_adapter = export_items(parts, None, False)
    bnb_optimizers.prepare(optimizer)  # a bitsandbytes state, as every rank count reads it
    opt_items, opt_other, groups = _optimizer_items(model, optimizer)
    manifest = {
        "format": FORMAT,
        "step": step,
        "extra": _to_json(extra or {}, "`extra`"),
        "world_size": collectives.world_size(),
        "weights": ADAPTER_FILE if is_adapter else "model.safetensors",
        "optimizer_class": type(optimizer).__name__,
        "param_groups": _to_json(groups, "optimizer param groups"),
        "optimizer_state": _to_json(opt_other, "optimizer state"),
        "scheduler": _to_json(scheduler.state_dict(), "scheduler.state_dict()") if scheduler is not None else None,
    }
    rng = _rng_state()

    def small_files(staging: Path) -> None:  # rank 0
        write_configs(parts, staging, adapter, None)
        if write_extra is not None:
            write_extra(staging)

    def after() -> None:  # rank 0, the state committed, still under the target's lock
        if keep_last is not None:
            _rotate(directory.parent, keep_last)
        if after_commit is not None:
            after_commit()

    def commit(items: dict[str, list], small_files, group=None) -> None:
        model_items, opt_items = items[MODEL_ITEMS], items[OPTIMIZER_ITEMS]
        weights_name = ADAPTER_FILE if is_adapter else "model.safetensors"
        with committed_directory(directory, weights_names=(weights_name, OPTIMIZER_FILE), what="saving state",
                                 durable=durable, group=group,
                                 after_commit=after if keep_last is not None or after_commit is not None else None
                                 ) as staging:
            write_tensors(model_items, staging, weights_name=weights_name, progress=progress, durable=durable)
            if opt_items:
                write_tensors(opt_items, staging, weights_name=OPTIMIZER_FILE, progress=progress, durable=durable)
            (staging / "rng").mkdir(exist_ok=True)
            write_json(staging / "rng" / f"rank-{collectives.rank():05d}.json", rng, durable=durable)
            if collectives.rank() == 0:
                small_files(staging)
                write_json(staging / MANIFEST, manifest, durable=durable)
                write_json(staging / MARKER, {"format": FORMAT, "step": step}, durable=durable)

    items = {MODEL_ITEMS: model_items, OPTIMIZER_ITEMS: opt_items}
    if blocking:
        commit(items, small_files)
        return directory
    return async_save.start(directory, commit, items, small_files, durable)


_MANIFEST_TYPES = {"step": int, "extra": dict, "world_size": int, "weights": str, "param_groups": list,
                   "optimizer_state": dict}


_NUMERIC_HYPERPARAMETERS = {"lr", "initial_lr", "weight_decay", "eps", "momentum", "dampening", "betas", "alpha"}


def read_manifest(directory: str | os.PathLike) -> dict:
    """The manifest of a complete state directory, its fields checked; a `CheckpointError` naming
    the file for a partial, foreign or damaged one."""
    directory = Path(directory)
    if not directory.is_dir():
        hint = ""
        if staging_path(directory.absolute()).exists() or old_path(directory.absolute()).exists():
            hint = " A save to it was interrupted; the next save to it repairs the leftovers."
        raise CheckpointError(f"{directory}: no such state directory.{hint}")
    if not (directory / MARKER).exists():
        raise CheckpointError(f"{directory}: incomplete training state (no {MARKER}); it was not fully saved "
                              "and cannot be resumed from.")
    read_json_file(directory / MARKER, limit=1 << 20)
    where = directory / MANIFEST
    manifest = read_json_file(where)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointError(f"{where}: format {found!r}, expected {FORMAT!r}.")
    for key, kind in _MANIFEST_TYPES.items():
        if not isinstance(manifest.get(key), kind) or kind is int and isinstance(manifest[key], bool):
            raise CheckpointError(f"{where}: `{key}` must be a {kind.__name__}, found {manifest.get(key)!r:.80}.")
    if manifest["step"] < 0 or manifest["world_size"] < 1:
        raise CheckpointError(f"{where}: `step` {manifest['step']} / `world_size` {manifest['world_size']} out of range.")
    for i, group in enumerate(manifest["param_groups"]):
        if not isinstance(group, dict) or not isinstance(group.get("params"), list) or not all(
                isinstance(p, str) for p in group["params"]):
            raise CheckpointError(f"{where}: param group {i} must be an object with a `params` list of names.")
        for key in _NUMERIC_HYPERPARAMETERS & group.keys():
            values = group[key] if isinstance(group[key], list) else [group[key]]
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
                raise CheckpointError(f"{where}: param group {i}: `{key}` must be a number, found {group[key]!r:.80}.")
    if manifest.get("scheduler") is not None and not isinstance(manifest["scheduler"], dict):
        raise CheckpointError(f"{where}: `scheduler` must be an object or null.")
    return manifest


def load_state(directory: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
               scheduler: Any = None, *, load_weights: bool = True, progress: bool | None = None) -> tuple[int, dict]:
    """Restore a state saved by `save_state` on any number of ranks; returns (step, extra).

    Everything is read and checked first (manifest, RNG file, weights and optimizer tensors against
    the model and optimizer); only then is anything changed, so a damaged or foreign checkpoint
    raises one `CheckpointError` naming the file and leaves the model and optimizer as they were.
    Each rank reads only the rows of its own shards. RNG: see `load_rng_state`.
    `load_weights=False` skips the model weights (already loaded with `load_pretrained`).
    Collective: call on every rank.
    """
    async_save.wait_pending()  # a save still in flight may be of this very directory
    directory = Path(directory)
    manifest = read_manifest(directory)
    rng_file = _rng_file(directory)
    rng = read_json_file(rng_file)
    check_rng_state(rng, rng_file)
    if scheduler is not None and manifest.get("scheduler") is None:
        raise CheckpointError(f"{directory / MANIFEST}: no scheduler state was saved.")
    weights = WeightsPlan(model_parts(model), directory) if load_weights else None
    try:
        if optimizer is not None:
            bnb_optimizers.prepare(optimizer)  # a bitsandbytes optimizer reads its 8-bit state by rows
        opt_plan = OptimizerPlan(model, optimizer, directory, manifest) if optimizer is not None else None
    except BaseException:
        if weights is not None:
            weights.close()
        raise
    if weights is not None:
        weights.read(progress)
    if opt_plan is not None:
        opt_plan.apply(optimizer, manifest)
    if scheduler is not None:
        scheduler.load_state_dict(manifest["scheduler"])
    _set_rng_state(rng)
    return manifest["step"], manifest["extra"]


def _rng_file(directory: Path) -> Path:
    """Rank r's saved RNG states (rank 0's when the checkpoint had fewer ranks)."""
    rng_file = directory / "rng" / f"rank-{collectives.rank():05d}.json"
    return rng_file if rng_file.exists() else directory / "rng" / "rank-00000.json"


def load_rng_state(directory: str | os.PathLike) -> None:
    """Rank r restores rank r's saved RNG states (rank 0's when the checkpoint had fewer ranks)."""
    rng_file = _rng_file(Path(directory))
    state = read_json_file(rng_file)
    check_rng_state(state, rng_file)
    _set_rng_state(state)


def list_states(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, directory) of every complete state directly under `root`, oldest first.

    Partial saves (no marker, staging leftovers) are never listed.
    """
    root = Path(root)
    found = []
    for child in root.iterdir() if root.is_dir() else []:
        # A symlink (a user's "best" link) is not a state of its own: its target is listed by name.
        if child.is_dir() and not child.is_symlink() and not child.name.startswith(".") and (child / MARKER).exists():
            try:
                found.append((read_manifest(child)["step"], child))
            except CheckpointError as e:
                logger.debug("skipping %s: %s", child, e)
    return sorted(found)


def latest_state(root: str | os.PathLike) -> Path | None:
    """The complete state with the highest step under `root`, or None."""
    states = list_states(root)
    return states[-1][1] if states else None


def _rotate(root: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` states under `root`, never one a symlink beside them
    points to (the user keeps it: a "best" link must not dangle)."""
    linked = {os.path.realpath(child) for child in root.iterdir() if child.is_symlink()}
    for _, path in list_states(root)[:-keep_last]:
        if os.path.realpath(path) not in linked:
            shutil.rmtree(path)
