"""FSDP2's private per-module state, read the same way on every supported torch (2.11 to 2.15).

The one place that branches on torch's version for FSDP2 internals. What differs:
- torch 2.12 and later hold a list of parameter groups per state (`FSDPState._fsdp_param_groups`);
  2.11 holds one (`FSDPState._fsdp_param_group`, None for a state without parameters). 2.12+ keep the
  singular name as a property that raises when a state has several groups, so only the plural is read
  there.
- torch 2.13 factors the mixed-precision casts of FSDP2's forward hooks into methods
  (`FSDPState._cast_forward_inputs`, `_cast_output_dtype`); 2.11 and 2.12 inline the same code in
  `_pre_forward` / `_post_forward` (torch/distributed/fsdp/_fully_shard/_fsdp_state.py), which is
  reproduced below from its helpers (`_fsdp_common._cast_fp_tensor`, `torch.distributed.utils.
  _apply_to_tensors`), both present in 2.11 to 2.15 (tests/test_upstream_contracts.py).
"""

from __future__ import annotations

import functools
from typing import Any


def shards_integer_parameters() -> bool:
    """Whether `fully_shard` can shard a parameter of an integer dtype (hf_fsdp2's uint8 4-bit weights): torch 2.13
    creates the sharded parameter with the original's requires_grad (`FSDPParam._init_sharded_param`); 2.11 with
    `nn.Parameter(dtensor)`, whose default requires_grad=True an integer tensor refuses ("only Tensors of floating
    point dtype can require gradients"; found in the GPU image's torch 2.11). 2.12 was not read: taken as 2.11."""
    import torch

    return torch.__version__ >= (2, 13)

# Whether this torch has FSDPState._fsdp_param_groups (2.12+): read from a state, not the version
# string, so a build with the change takes the new path whatever it calls itself.
_PLURAL: bool | None = None


def _has_plural_groups(state) -> bool:
    global _PLURAL
    if _PLURAL is None:
        _PLURAL = "_fsdp_param_groups" in vars(state)
    return _PLURAL


def param_groups(state) -> list:
    """The `FSDPParamGroup`s of an `FSDPState` (empty for a state without parameters)."""
    if _has_plural_groups(state):
        return list(state._fsdp_param_groups)
    group = state._fsdp_param_group  # torch 2.11: one group or None
    return [group] if group is not None else []


def cast_forward_inputs(state, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """What FSDP2's pre-forward hook does to the inputs under a mixed-precision policy."""
    if hasattr(state, "_cast_forward_inputs"):  # torch 2.13+
        return state._cast_forward_inputs(args, kwargs)
    policy = state._mp_policy
    if not (policy.cast_forward_inputs and policy.param_dtype):
        return args, kwargs
    cast, apply = _cast_helpers()
    fn = functools.partial(cast, policy.param_dtype)
    return apply(fn, args), apply(fn, kwargs)


def cast_output(state, output: Any) -> Any:
    """What FSDP2's post-forward hook does to the output under a mixed-precision policy."""
    if hasattr(state, "_cast_output_dtype"):  # torch 2.13+
        return state._cast_output_dtype(output)
    if state._mp_policy.output_dtype is None:
        return output
    cast, apply = _cast_helpers()
    return apply(functools.partial(cast, state._mp_policy.output_dtype), output)


def _cast_helpers():
    from torch.distributed.fsdp._fully_shard._fsdp_common import _cast_fp_tensor
    from torch.distributed.utils import _apply_to_tensors

    return _cast_fp_tensor, _apply_to_tensors
