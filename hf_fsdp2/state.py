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
import os
import random
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .atomic_dir import agree, committed_directory, old_path, staging_path
from .pretrained import (
    ADAPTER_FILE, export_items, write_configs, load_pretrained, load_tensors, write_tensors,
)
from .safetensors_io import CheckpointError, CheckpointFiles, write_json
from .tensor_export import ExportTensor, model_tensors

FORMAT = "hf_fsdp2.state/1"
MARKER = "COMPLETE.json"
MANIFEST = "hf_fsdp2_state.json"  # not trainer_state.json: the Trainer writes its own beside it
OPTIMIZER_FILE = "optimizer.safetensors"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


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


def _load_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path, manifest: dict) -> None:
    names = _param_names(model)
    saved_groups = manifest["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise CheckpointError(f"{directory / MANIFEST}: {len(saved_groups)} optimizer param groups saved, the "
                              f"optimizer has {len(optimizer.param_groups)}.")
    by_name: dict[str, torch.Tensor] = {}
    for saved, group in zip(saved_groups, optimizer.param_groups):
        current = [names.get(id(p)) for p in group["params"]]
        if current != saved["params"]:
            diff = sorted(set(map(str, current)) ^ set(saved["params"]))
            raise CheckpointError(f"{directory / MANIFEST}: optimizer parameters differ from the checkpoint's: "
                                  f"{', '.join(diff[:10])}.")
        group.update({k: v for k, v in saved.items() if k != "params"})
        by_name.update({names[id(p)]: p for p in group["params"]})
    files = CheckpointFiles(directory, OPTIMIZER_FILE) if (directory / OPTIMIZER_FILE).exists() or (
        directory / (OPTIMIZER_FILE + ".index.json")).exists() else None
    optimizer.state.clear()
    targets: dict[str, torch.Tensor] = {}
    for key in (files.names() if files is not None else []):
        name, _, state_key = key.rpartition("/")
        if name not in by_name:
            raise CheckpointError(f"{directory / OPTIMIZER_FILE}: state for unknown parameter {name!r}.")
        param, spec = by_name[name], files.spec(key)
        # States shaped like their parameter are sharded like it; others (Adam's step) are whole.
        like_param = tuple(spec.shape) == tuple(param.shape) and isinstance(param, DTensor)
        target = torch.zeros_like(param, dtype=spec.dtype) if like_param else torch.zeros(
            spec.shape, dtype=spec.dtype, device=param.device if not isinstance(param, DTensor) else "cpu")
        optimizer.state[param][state_key] = target
        targets[key] = target
    if files is not None:
        load_tensors(targets, files)
    for name, values in manifest.get("optimizer_state", {}).items():
        optimizer.state[by_name[name]].update(values)


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
               durable: bool = True) -> Path:
    """Save model, optimizer, scheduler and RNG states to `directory`, committed atomically.

    `extra`: any JSON-serialisable dict, returned by `load_state`. `keep_last=N` deletes older
    complete states in the same parent directory, keeping the N with the highest step.
    `write_extra(staging_dir)`: runs on rank 0 to add files (a tokenizer, the Trainer's state) that
    must commit together with the checkpoint. `durable=False` skips the fsyncs (see `save_pretrained`).
    Collective: call on every rank.
    """
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"`step`={step!r} must be a non-negative int.")
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"`keep_last`={keep_last!r} must be a positive int or None.")
    directory = Path(directory).absolute()
    model_items, is_adapter = export_items(model, None, False)
    opt_items, opt_other, groups = _optimizer_items(model, optimizer)
    manifest = {
        "format": FORMAT,
        "step": step,
        "extra": _to_json(extra or {}, "`extra`"),
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "weights": ADAPTER_FILE if is_adapter else "model.safetensors",
        "optimizer_class": type(optimizer).__name__,
        "param_groups": _to_json(groups, "optimizer param groups"),
        "optimizer_state": _to_json(opt_other, "optimizer state"),
        "scheduler": _to_json(scheduler.state_dict(), "scheduler.state_dict()") if scheduler is not None else None,
    }
    weights_name = ADAPTER_FILE if is_adapter else "model.safetensors"
    with committed_directory(directory, weights_names=(weights_name, OPTIMIZER_FILE), what="saving state",
                             durable=durable) as staging:
        write_tensors(model_items, staging, weights_name=weights_name,
                      progress=progress, durable=durable)
        if opt_items:
            write_tensors(opt_items, staging, weights_name=OPTIMIZER_FILE, progress=progress, durable=durable)
        (staging / "rng").mkdir(exist_ok=True)
        write_json(staging / "rng" / f"rank-{_rank():05d}.json", _rng_state(), durable=durable)
        if _rank() == 0:
            write_configs(model, staging, is_adapter, None)
            if write_extra is not None:
                write_extra(staging)
            write_json(staging / MANIFEST, manifest, durable=durable)
            write_json(staging / MARKER, {"format": FORMAT, "step": step}, durable=durable)
    error = None
    if keep_last is not None and _rank() == 0:
        try:
            _rotate(directory.parent, keep_last)
        except OSError as e:
            error = e
    agree(error, f"rotating states beside {directory}")
    return directory


def read_manifest(directory: str | os.PathLike) -> dict:
    """The manifest of a complete state directory; a clear error for a partial or foreign one."""
    directory = Path(directory)
    if not directory.is_dir():
        hint = ""
        if staging_path(directory.absolute()).exists() or old_path(directory.absolute()).exists():
            hint = " A save to it was interrupted; the next save to it repairs the leftovers."
        raise CheckpointError(f"{directory}: no such state directory.{hint}")
    if not (directory / MARKER).exists():
        raise CheckpointError(f"{directory}: incomplete training state (no {MARKER}); it was not fully saved "
                              "and cannot be resumed from.")
    try:
        manifest = json.loads((directory / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{directory / MANIFEST}: unreadable manifest ({e}).") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{directory / MANIFEST}: format {manifest.get('format')!r}, expected {FORMAT!r}.")
    return manifest


def load_state(directory: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
               scheduler: Any = None, *, load_weights: bool = True, progress: bool | None = None) -> tuple[int, dict]:
    """Restore a state saved by `save_state` on any number of ranks; returns (step, extra).

    Each rank reads only the rows of its own shards. RNG: see `load_rng_state`.
    `load_weights=False` skips the model weights (already loaded with `load_pretrained`).
    Collective: call on every rank.
    """
    directory = Path(directory)
    manifest = read_manifest(directory)
    if load_weights:
        load_pretrained(model, directory, progress=progress)
    if optimizer is not None:
        _load_optimizer(model, optimizer, directory, manifest)
    if scheduler is not None:
        if manifest.get("scheduler") is None:
            raise CheckpointError(f"{directory / MANIFEST}: no scheduler state was saved.")
        scheduler.load_state_dict(manifest["scheduler"])
    load_rng_state(directory)
    return manifest["step"], manifest["extra"]


def load_rng_state(directory: str | os.PathLike) -> None:
    """Rank r restores rank r's saved RNG states (rank 0's when the checkpoint had fewer ranks)."""
    rng_dir = Path(directory) / "rng"
    rng_file = rng_dir / f"rank-{_rank():05d}.json"
    if not rng_file.exists():
        rng_file = rng_dir / "rank-00000.json"
    _set_rng_state(json.loads(rng_file.read_text(encoding="utf-8")))


def list_states(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, directory) of every complete state directly under `root`, oldest first.

    Partial saves (no marker, staging leftovers) are never listed.
    """
    root = Path(root)
    found = []
    for child in root.iterdir() if root.is_dir() else []:
        if child.is_dir() and not child.name.startswith(".") and (child / MARKER).exists():
            try:
                found.append((read_manifest(child)["step"], child))
            except CheckpointError:
                continue
    return sorted(found)


def latest_state(root: str | os.PathLike) -> Path | None:
    """The complete state with the highest step under `root`, or None."""
    states = list_states(root)
    return states[-1][1] if states else None


def _rotate(root: Path, keep_last: int) -> None:
    for _, path in list_states(root)[:-keep_last]:
        shutil.rmtree(path)
