"""GPU process-group semantics for scripts run under `accelerate launch` / torchrun.

With `TEST_DEFAULT_BACKEND=cuda:gloo` a script initialises the default group itself before Accelerate
or the Trainer would: Accelerate's `PartialState` (and so `TrainingArguments`) then keeps the group it
finds (`torch.distributed.is_initialized()`, accelerate/state.py) instead of starting gloo. That group
refuses CPU tensors as NCCL does (tests/dist_harness.py `NCCL_LIKE`).

One thing a CPU cannot show as a GPU would: Accelerate's and the Trainer's own collectives (loss and
token-count gathers, `wait_for_everyone`) carry `accelerator.device` tensors, CUDA on a GPU but CPU
here. So on the default group, and only for callers outside hf_fsdp2, the harness hands those calls to
a gloo group; hf_fsdp2's own calls go to the default group untouched and fail on a CPU tensor.
"""

from __future__ import annotations

import os

ENV = "TEST_DEFAULT_BACKEND"


def init_if_asked() -> None:
    backend = os.environ.get(ENV)
    if not backend:
        return
    import torch.distributed as dist

    dist.init_process_group(backend)  # env:// from the launcher
    _route_other_callers_to_gloo(dist)


_NAMES = ("all_gather", "all_gather_into_tensor", "all_reduce", "broadcast", "barrier", "all_gather_object",
          "broadcast_object_list", "gather_object", "gather", "reduce", "scatter")


def _route_other_callers_to_gloo(dist) -> None:
    import functools
    import sys

    side = dist.new_group(backend="gloo")

    def route(name, original):
        @functools.wraps(original)
        def call(*args, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if kwargs.get("group") in (None, dist.group.WORLD) and not caller.startswith("hf_fsdp2"):
                kwargs["group"] = side
            return original(*args, **kwargs)
        return call

    for name in _NAMES:
        setattr(dist, name, route(name, getattr(dist, name)))

