"""Accelerate's `fsdp_cpu_ram_efficient_loading`: shard a model whose weights rank 0 holds.

transformers loads the checkpoint on rank 0 (other ranks may hold meta tensors, or, with a quantized
model, the same weights again). We shard an empty model, then rank 0 broadcasts one tensor at a time
and every rank keeps only its own rows: peak, one full tensor per rank. 4-bit (bitsandbytes) layers
are first given the packed row layout of quantization/bnb_4bit.py on every rank, so what travels is
rank 0's packed rows, absmax and double-quantization state, kept row by row as float weights are.
For no full copy on any rank, load with `hf_fsdp2.from_pretrained` instead.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..config import FSDP2Config
from ..quantization import quantized
from ..runtime import collectives, upstream
from ..runtime.distributed import local_tensor
from ..shard import shard_model
from .tensor_export import model_tensors, row_range

# What a 4-bit layer dequantizes to, as one number rank 0 broadcasts (meta layers have no QuantState).
_DEQUANT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # broadcast as an index


def shard_from_rank0(model: nn.Module, config: FSDP2Config, mesh) -> nn.Module:
    """Shard `model` with rank 0's weights and buffers in every rank's shards. Collective: call on every rank."""
    device = collectives.mesh_device(mesh)  # NCCL broadcasts device tensors
    is_source = collectives.rank() == 0
    _prepare_4bit_layers(model, mesh, is_source)
    sources = dict(model_tensors(model)) if is_source else {}
    buffers = dict(model.named_buffers()) if is_source else {}
    meta: dict[int, nn.Parameter] = {}  # tied weights stay tied
    for module in model.modules():
        for key, param in module._parameters.items():
            if param is not None:
                if id(param) not in meta:
                    meta[id(param)] = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
                upstream.set_entry(module, "_parameters", key, meta[id(param)], "torch.nn.Module._parameters")
    shard_model(model, config, mesh=mesh, init_weights=False)
    with torch.no_grad():
        targets = list(model_tensors(model).items()) + [(f"buffer:{n}", b) for n, b in model.named_buffers()]
        for name, target in targets:
            source = buffers.get(name[len("buffer:"):]) if name.startswith("buffer:") else sources.get(name)
            if is_source and (source is None or source.is_meta):
                raise ValueError(f"`fsdp_cpu_ram_efficient_loading`: rank 0 has no weights for {name!r}; "
                                 "load the model with from_pretrained on rank 0 (or use hf_fsdp2.from_pretrained).")
            if is_source and source.shape != target.shape:
                raise ValueError(f"`fsdp_cpu_ram_efficient_loading`: {name!r} is {tuple(source.shape)} on rank 0 "
                                 f"and {tuple(target.shape)} here; every rank must build the same model.")
            full = (source.to(device=device, dtype=target.dtype).contiguous() if is_source
                    else torch.empty(target.shape, dtype=target.dtype, device=device))
            collectives.broadcast_from_first(full, mesh)
            start, stop = row_range(target)
            local = local_tensor(target)
            local.copy_(full[start:stop] if full.dim() else full)
    return model


def _prepare_4bit_layers(model: nn.Module, mesh, is_source: bool) -> None:
    """Give every rank's 4-bit layers the same packed row layout: rank 0's are quantized; another
    rank's may be meta, so they take the dequantization dtype rank 0 broadcasts. Collective when the
    model has 4-bit layers (every rank builds the same model, so all agree)."""
    layers = quantized.unprepared_layers(model)
    if not layers:
        return
    code = torch.zeros(1, dtype=torch.int64)
    if is_source:
        dtypes = {name: q.source_dtype(name, m) for name, m, q in layers}
        if len(set(dtypes.values())) != 1:
            raise ValueError("`fsdp_cpu_ram_efficient_loading` with 4-bit layers of different dtypes "
                             f"({dtypes}) is not supported; load with hf_fsdp2.from_pretrained.")
        code[0] = _DEQUANT_DTYPES.index(next(iter(dtypes.values())))
    collectives.broadcast_from_first(code, mesh)
    quantized.prepare(model, _DEQUANT_DTYPES[int(code[0])])
