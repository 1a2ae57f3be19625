"""Activation offload: what each decoder layer saves for backward goes to host memory in forward and
comes back in backward (`FSDP2Config(activation_offload=True)`).

A memory lever between checkpointing (recompute, no copies) and parameter offload: no recomputation,
two host-device copies of every saved activation per step (pinned host buffers on CUDA, so the copies
can overlap compute). Built on torch's saved-tensor hooks (`torch.autograd.graph.saved_tensors_hooks`,
the mechanism of `torch.autograd.graph.save_on_cpu`), entered around each decoder layer's forward by
module hooks, so what the embedding, final norm, head and loss save stays on the device. Parameters
are not copied: FSDP2 frees a layer's gathered weights after forward and gathers them again for
backward, and a copy would keep them alive on the host for nothing. On a CPU device nothing moves
(host and device are one memory): the lever only exists on accelerators, and the planner offers it
there only.
"""

from __future__ import annotations

import torch
import torch.nn as nn


def saved_tensor_hooks(copy_host_tensors: bool = False, counter: list | None = None):
    """(pack, unpack) moving a saved tensor to the host and back. `copy_host_tensors`: copy tensors
    already on the host too (the CPU tests' stand-in for a device, so the round trip is exercised);
    `counter`: a list each moved tensor's bytes are appended to."""
    def pack(tensor: torch.Tensor):
        if isinstance(tensor, nn.Parameter) or (tensor.device.type == "cpu" and not copy_host_tensors):
            return tensor
        host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout,
                           pin_memory=tensor.device.type == "cuda" and not tensor.is_sparse)
        host.copy_(tensor, non_blocking=True)
        if counter is not None:
            counter.append(host.numel() * host.element_size())
        return (tensor.device, host)

    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return host.to(device, non_blocking=True) if device.type != "cpu" else host.clone()

    return pack, unpack


def apply_activation_offload(layers: list[nn.Module], **hooks_kwargs) -> None:
    """Each layer's forward runs inside saved-tensor hooks that move what autograd saves to the host."""
    pack, unpack = saved_tensor_hooks(**hooks_kwargs)
    for layer in layers:
        state: list = []

        def enter(module, args, kwargs, state=state):
            hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
            hooks.__enter__()
            state.append(hooks)

        def leave(module, args, kwargs, output, state=state):
            if state:
                state.pop().__exit__(None, None, None)

        layer.register_forward_pre_hook(enter, with_kwargs=True)
        layer.register_forward_hook(leave, with_kwargs=True, always_call=True)


__all__ = ["apply_activation_offload", "saved_tensor_hooks"]
