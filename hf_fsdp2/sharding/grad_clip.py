"""Gradient clipping over every device mesh a model's gradients live on.

torch's `clip_grad_norm_` stacks the norms of all gradients into one tensor, which DTensor refuses for norms on
different meshes ("All operands in aten.stack.default must have the same mesh"): an expert-parallel model has
its experts on the ("efsdp", "ep") mesh and the rest on the data-parallel mesh (sharding/expert_parallel/).
`clip_grad_norm_` here takes the norm per mesh, combines the full norms (what Accelerate's
`Accelerator.clip_grad_norm_` does for FSDP2, `_clip_grad_norm_dtensor_aware`) and scales each gradient on its
own mesh with torch's `clip_grads_with_norm_`.

torch's own function is left to do every call it can do; a call on gradients of several meshes, which it cannot,
is refused naming this one (`refuse_in_torch`: a PATCHED seam, installed when a model is split by expert
parallelism, taken back by `hf_fsdp2.unregister()`).
"""

from __future__ import annotations

import functools
from typing import Iterable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..runtime import upstream

TARGET = "torch.nn.utils.clip_grad_norm_"
GROUP = "grad-clip"  # the upstream.py group of torch's clip_grad_norm_ refusal


def _listed(parameters) -> list[torch.Tensor]:
    if isinstance(parameters, nn.Module):
        parameters = parameters.parameters()
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


def _by_mesh(params: list[torch.Tensor]) -> dict:
    """The parameters with a gradient, by their gradient's device mesh (None: plain tensors)."""
    groups: dict = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    return groups


def clip_grad_norm_(parameters: nn.Module | torch.Tensor | Iterable[torch.Tensor], max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` for gradients on any number of device meshes (a model, or its
    parameters): the total norm over all of them, as one process computes it, every gradient scaled by
    `max_norm / total` where that is below 1. Returns the total norm (a plain tensor).
    Collective: call on every rank (one all-reduce per mesh)."""
    params = _listed(parameters)
    groups = _by_mesh(params)
    if len(groups) <= 1:
        return _torch_clip()(params, max_norm, norm_type, error_if_nonfinite, foreach)
    norms = [torch.nn.utils.get_total_norm([p.grad for p in group], norm_type, error_if_nonfinite, foreach)
             for group in groups.values()]
    norms = [norm.full_tensor() if isinstance(norm, DTensor) else norm for norm in norms]  # reduced on its mesh
    total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
    for mesh, group in groups.items():
        norm = total if mesh is None else DTensor.from_local(total, mesh)  # replicated: the same on every rank
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm, foreach)
    return total


def _torch_clip():
    return upstream.original(TARGET) if TARGET in upstream.installed() else upstream.lookup(TARGET)


def _refusing(original):
    @functools.wraps(original)
    def clip_grad_norm_(parameters, max_norm, *args, **kwargs):
        params = _listed(parameters)  # a generator is read once, here: torch gets the same tensors as a list
        meshes = [mesh for mesh in _by_mesh(params) if mesh is not None]
        if len(meshes) > 1:
            names = "; ".join(str(dict(zip(mesh.mesh_dim_names or (), mesh.shape))) for mesh in meshes)
            raise ValueError(f"torch.nn.utils.clip_grad_norm_ cannot combine gradients on {len(meshes)} device "
                             f"meshes ({names}; an expert-parallel model keeps its experts on their own): use "
                             "hf_fsdp2.clip_grad_norm_(model, max_norm), which takes the norm per mesh and clips "
                             "every gradient (under Accelerate: accelerator.clip_grad_norm_).")
        return original(params, max_norm, *args, **kwargs)
    return clip_grad_norm_


def refuse_in_torch() -> None:
    """torch's `clip_grad_norm_` refuses, by name, gradients on several meshes (idempotent)."""
    upstream.replace(TARGET, _refusing(upstream.lookup(TARGET)), GROUP)


def unregister() -> None:
    upstream.restore(GROUP)


__all__ = ["clip_grad_norm_", "refuse_in_torch", "unregister"]
