"""bitsandbytes' 8-bit optimizers (AdamW8bit, PagedAdamW8bit, Lion8bit, ...; the Trainer's
`optim="adamw_8bit"`) stepping on FSDP2's sharded parameters.

bitsandbytes' kernels take `p`, `p.grad` and the state as plain tensors, so on a DTensor parameter
the first step fails ("got mixed torch.Tensor and DTensor"). An element-wise optimizer needs no
communication: each rank steps its own rows. A prepared optimizer runs bitsandbytes' own `step`, whose
per-parameter `init_state`/`update_step` get this rank's rows of the parameter and its gradient, and
its part of the state.

The state stays resumable on any rank count: bitsandbytes quantizes a parameter's state in blocks of
256 consecutive values of the flattened tensor, with one float32 `absmax` per block. When a row's
length is a multiple of 256, every block lies inside one row, so the state (`state1`/`state2`, one
uint8 per value) and `absmax` (kept as `[rows, row_length / 256]`) split by rows like the parameter:
our checkpoints write and read them by rows, as they do the parameter. A sharded parameter whose rows
are not a multiple of 256 (norms, biases, tiny models) keeps 32-bit state instead, as bitsandbytes
already does for tensors below `min_8bit_size` (counted on the whole tensor, not this rank's rows, so
the choice does not depend on the number of ranks). Refused by name: LAMB/LARS (`max_unorm`: a norm
over the whole tensor) and optimizers that lay out their state otherwise (AdEMAMix).
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..runtime import upstream

SEAM = "bitsandbytes.optim.optimizer.Optimizer8bit.step"
BLOCKSIZE = 256  # bitsandbytes' blockwise 8-bit optimizer state (Optimizer1State/2State.init_state)
ROW_SPLIT = ("state1", "state2")  # one value per parameter value
ABSMAX = ("absmax1", "absmax2")  # one float32 per block of BLOCKSIZE values


def _inner(optimizer: Any) -> Any:
    """The optimizer itself inside Accelerate's `AcceleratedOptimizer`."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def is_bitsandbytes_optimizer(optimizer: Any) -> bool:
    optimizer = _inner(optimizer)
    return any(c.__name__ == "Optimizer8bit" and c.__module__.startswith("bitsandbytes")
               for c in type(optimizer).__mro__)


def is_prepared(optimizer: Any) -> bool:
    return type(_inner(optimizer)) in _CLASSES.values()


def prepare(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Make a bitsandbytes optimizer step on each rank's rows (idempotent; anything else is returned
    as it is). Call after the optimizer holds the sharded parameters, before its first step."""
    if not is_bitsandbytes_optimizer(optimizer) or is_prepared(optimizer):
        return optimizer
    wrapper, optimizer = optimizer, _inner(optimizer)
    from bitsandbytes.optim.optimizer import Optimizer1State, Optimizer2State

    cls = type(optimizer)
    if cls.init_state not in (Optimizer1State.init_state, Optimizer2State.init_state):
        raise ValueError(f"{cls.__name__} (bitsandbytes) keeps its state in another layout than "
                         "Optimizer1State/Optimizer2State; hf_fsdp2 cannot step it on sharded parameters. Use "
                         "AdamW8bit/PagedAdamW8bit/Lion8bit (or torch.optim.AdamW).")
    if getattr(optimizer.args, "max_unorm", 0.0) > 0.0:
        raise ValueError(f"{cls.__name__} (bitsandbytes) with max_unorm={optimizer.args.max_unorm} (LAMB/LARS) "
                         "scales each update by the norm of the whole tensor; each rank holds only its rows. "
                         "Use max_unorm=0 or another optimizer.")
    upstream.set_class(optimizer, _prepared_class(cls), SEAM)
    for p, state in list(optimizer.state.items()):  # a state from an unprepared single process
        optimizer.state[p] = _global_state(p, {k: local_state(v) for k, v in state.items()})
    return wrapper


def _state_bits(p: torch.Tensor, config: dict) -> int:
    """32 or 8, decided on the whole tensor: 8 only when its state splits by rows (see above)."""
    if config["optim_bits"] == 32 or p.numel() < config["min_8bit_size"] or p.dim() < 2:
        return 32
    row_length = p.numel() // p.shape[0]
    return 8 if row_length % BLOCKSIZE == 0 else 32


class _ShardedStep:
    """Mixed into the optimizer's own class (same name). bitsandbytes' `step` is untouched (an LR
    scheduler may hold it already); it calls `init_state` and `update_step` per parameter, and those
    run bitsandbytes' own on this rank's rows and state."""

    def get_config(self, gindex, pindex, group):
        config = super().get_config(gindex, pindex, group)
        bits = _state_bits(self.param_groups[gindex]["params"][pindex], config)  # the whole tensor
        config.update(optim_bits=bits, min_8bit_size=0 if bits == 8 else config["min_8bit_size"])
        return config

    def init_state(self, group, p, gindex, pindex):
        local = _local_param(p)
        with _local_states(self, p, local) as state:
            super().init_state(group, local, gindex, pindex)
        self.state[p] = _global_state(p, state)

    def update_step(self, group, p, gindex, pindex):
        local = _local_param(p)
        try:
            with _local_states(self, p, local) as state:
                if local.numel():
                    super().update_step(group, local, gindex, pindex)
                else:  # no rows on this rank: the step count still advances
                    state["step"] += 1
            self.state[p] = _global_state(p, state, self.state[p])
        finally:
            if local is not p:
                local.grad = None


@contextlib.contextmanager
def _local_states(optimizer, p: torch.Tensor, local: torch.Tensor):
    """Inside, `optimizer.state` holds only `local`'s state (this rank's part of `p`'s), yielded."""
    held = optimizer.state
    state = {k: local_state(v, local.device, flat=k in ABSMAX) for k, v in held.get(p, {}).items()}
    optimizer.state = defaultdict(dict, {local: state})
    try:
        yield state
    finally:
        optimizer.state = held


def _local_param(p: torch.Tensor) -> torch.Tensor:
    """This rank's rows of `p`, carrying this rank's rows of the gradient."""
    if not isinstance(p, DTensor):
        return p
    local = p.to_local()
    if not local.is_contiguous():  # bitsandbytes would replace `.data` by a copy, detached from FSDP2's
        raise ValueError(f"a sharded parameter of shape {list(p.shape)} has non-contiguous local rows")
    local.grad = p.grad.to_local() if p.grad is not None else None
    return local


def local_state(value: Any, device: torch.device | None = None, flat: bool = False) -> Any:
    """The state value as bitsandbytes' kernels take it: this rank's part (`flat`: as a view of one
    dimension, bitsandbytes' absmax)."""
    if not isinstance(value, torch.Tensor):
        return value
    local = value.to_local() if isinstance(value, DTensor) else value
    if flat:
        local = local.view(-1)
    if device is not None and local.device != device:  # whole tensors (qmap) come back on the CPU
        local = local.to(device)
    return local


def _global_state(p: torch.Tensor, state: dict, previous: dict | None = None) -> dict:
    """bitsandbytes' local state as our checkpoints write it: row-split tensors as DTensors shaped like
    `p` (absmax as [rows, row_length / 256]), the rest (qmap, step) as they are. A tensor that is the
    local part of the `previous` DTensor keeps that DTensor (updated in place)."""
    previous = previous or {}
    rows = p.shape[0] if p.dim() else 1
    out = {}
    for key, value in state.items():
        before = previous.get(key)
        if isinstance(before, DTensor) and isinstance(value, torch.Tensor) and before.to_local() is value:
            out[key] = before
            continue
        if key in ABSMAX and value.dtype == torch.float32 and isinstance(value, torch.Tensor):
            value = _absmax_rows(p, value, rows)
        elif key in ROW_SPLIT and isinstance(p, DTensor) and value.shape != p.to_local().shape:
            raise ValueError(f"bitsandbytes state {key!r} of shape {list(value.shape)} does not match its "
                             f"parameter's rows {list(p.to_local().shape)}: bitsandbytes changed its layout")
        if isinstance(p, DTensor) and isinstance(value, torch.Tensor) and (key in ROW_SPLIT or key in ABSMAX):
            shape = p.shape if key in ROW_SPLIT else (rows, value.shape[1])
            value = DTensor.from_local(value, p.device_mesh, p.placements, run_check=False, shape=shape,
                                       stride=torch.empty(shape, device="meta").stride())
        out[key] = value
    return out


def _absmax_rows(p: torch.Tensor, absmax: torch.Tensor, rows: int) -> torch.Tensor:
    """A flat absmax as [rows, blocks per row] (a view), or flat when the blocks do not follow rows."""
    if absmax.dim() == 2:
        return absmax
    row_length = p.numel() // rows if rows else 0
    if p.dim() < 2 or row_length % BLOCKSIZE:
        if isinstance(p, DTensor):
            raise ValueError(f"8-bit state for a sharded parameter of shape {list(p.shape)}, whose rows are not "
                             f"a multiple of {BLOCKSIZE} values: it cannot be split by rows")
        return absmax
    local_rows = p.to_local().shape[0] if isinstance(p, DTensor) else rows
    blocks = math.ceil(local_rows * row_length / BLOCKSIZE)
    if absmax.numel() != blocks:
        raise ValueError(f"bitsandbytes keeps {absmax.numel()} absmax values for {local_rows} x {row_length} "
                         f"values, not one per {BLOCKSIZE}: its blockwise layout changed")
    return absmax.view(local_rows, row_length // BLOCKSIZE)


def empty_state(param: torch.Tensor, key: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor for a saved state value of a prepared optimizer, split by rows where the state is."""
    if isinstance(param, DTensor) and (key in ROW_SPLIT or key in ABSMAX) and shape and shape[0] == param.shape[0]:
        from torch.distributed.tensor import zeros

        return zeros(shape, dtype=dtype, device_mesh=param.device_mesh, placements=param.placements)
    if isinstance(param, DTensor) and (key in ROW_SPLIT or key in ABSMAX):
        raise ValueError(f"saved bitsandbytes state {key!r} {list(shape)} does not split by the rows of its "
                         f"parameter {list(param.shape)} (saved by an optimizer hf_fsdp2 had not prepared)")
    device = param.to_local().device if isinstance(param, DTensor) else param.device
    return torch.zeros(shape, dtype=dtype, device=device)


_CLASSES: dict[type, type] = {}


def _prepared_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(cls.__name__, (_ShardedStep, cls), {"__module__": cls.__module__})
    return _CLASSES[cls]
