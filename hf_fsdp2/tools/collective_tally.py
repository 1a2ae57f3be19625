"""Every collective a step issues, with the bytes it would move, seen where all of them pass: torch's
dispatcher. A `TorchDispatchMode` sees the c10d ops (`dist.all_gather_into_tensor` -> `c10d::_allgather_base_`:
FSDP2's gathers and reduce-scatters, DTensor's redistributions, hf_fsdp2's host-group flags) and the
functional ones (`_c10d_functional*`: transformers' expert all-to-all, compiled collectives) with the real
per-rank shapes, whatever process group runs them.

Under torch's fake group (tools/simulate.py) one collective result matters to the shapes that follow:
transformers' AllToAllEP sends each peer its per-expert token counts and sizes the token exchange by what
it receives, which the fake group leaves unwritten. The tally writes it as a **symmetric exchange**: every
peer sends this rank as many tokens per expert as this rank sends it (balanced routing; an assumption the
report states). No other result is touched: gathered parameters hold whatever the buffer held.

Bytes per rank on the wire follow NCCL's ring algorithms, as nccl-tests' "bus bandwidth" counts them:
all-gather (n-1)/n of the gathered output, reduce-scatter (n-1)/n of the input, all-reduce 2(n-1)/n,
all-to-all (n-1)/n of the input, broadcast the whole buffer.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

# op name (without namespace and overload) -> kind; the kind decides which tensor is the buffer and the ring factor
_KINDS = {
    "_allgather_base_": "all_gather", "allgather_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce", "all_reduce_coalesced": "all_reduce", "all_reduce_coalesced_": "all_reduce",
    "alltoall_base_": "all_to_all", "alltoall_": "all_to_all", "all_to_all_single": "all_to_all",
    "broadcast_": "broadcast", "broadcast": "broadcast",
}
_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")
# Ops of those namespaces that move nothing (waits, barriers' empty tensors) are tallied as "other" with 0 bytes.


@dataclass
class Collective:
    """One collective as issued on this rank."""

    kind: str
    op: str
    group_ranks: tuple[int, ...]
    buffer_bytes: int  # the gathered output / the reduce-scattered input / the reduced or exchanged tensor
    wire_bytes: int  # what this rank sends (= receives) by the ring algorithm

    def to_dict(self) -> dict:
        return asdict(self)


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _nbytes(value) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(value))


def _group_ranks(args, kwargs) -> tuple[int, ...]:
    for value in (*args, *(kwargs or {}).values()):
        group = None
        if isinstance(value, str):  # the functional ops name their group
            try:
                group = torch._C._distributed_c10d._resolve_process_group(value)
            except (RuntimeError, ValueError):
                continue
        elif isinstance(value, torch.ScriptObject):  # c10d ops carry their group boxed (torch's own spelling
            try:                                     # of the unboxing: distributed_c10d._resolve_group_name)
                group = dist.ProcessGroup.unbox(value)
            except (RuntimeError, TypeError):
                continue
        if group is not None:
            try:
                return tuple(dist.get_process_group_ranks(group))
            except (RuntimeError, ValueError):  # a group torch's registry does not know: its size is what counts
                return tuple(range(group.size()))
    return (dist.get_rank(),) if dist.is_initialized() else (0,)


def _ring_wire_bytes(kind: str, buffer_bytes: int, n: int) -> int:
    if n <= 1:
        return 0
    factor = {"all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_reduce": 2 * (n - 1) / n,
              "all_to_all": (n - 1) / n, "broadcast": 1.0}.get(kind, 0.0)
    return int(buffer_bytes * factor)


class CollectiveTally(TorchDispatchMode):
    """`with CollectiveTally(symmetric_all_to_all=...) as tally:` ...; `tally.calls`: every `Collective` in order."""

    def __init__(self, *, symmetric_all_to_all: bool = False):
        super().__init__()
        self.symmetric_all_to_all = symmetric_all_to_all
        self.calls: list[Collective] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            # A mode runs before tensor subclasses: returning NotImplemented lets DTensor dispatch with this mode
            # still on the stack, so the collectives it issues inside (TP's redistributions, context parallelism's
            # ring of K/V blocks) come back here as plain ops; calling func here would run them with the mode off
            # and miss them. torch's own CommDebugMode does the same (torch/distributed/tensor/debug/_comm_mode.py).
            return NotImplemented
        out = func(*args, **kwargs)
        if func.namespace not in _NAMESPACES:
            return out
        name = func._opname
        kind = _KINDS.get(name)
        if kind is None:
            return out
        ranks = _group_ranks(args, kwargs)
        if kind == "all_gather":  # the gathered output: the outputs of c10d's in-place ops, the result of funcol's
            buffer = _nbytes(args[0]) if func.namespace == "c10d" else _nbytes(out)
        elif kind == "reduce_scatter":
            buffer = _nbytes(args[1]) if func.namespace == "c10d" else _nbytes(args[0])
        elif kind == "all_to_all":
            buffer = _nbytes(args[1]) if func.namespace == "c10d" else _nbytes(args[0])
            if self.symmetric_all_to_all and func.namespace == "c10d" and name == "alltoall_base_":
                output, source = args[0], args[1]
                if output.shape == source.shape:  # the counts exchange (see the module docstring)
                    with torch.no_grad():
                        output.copy_(source)
        else:
            buffer = _nbytes(args[0])
        self.calls.append(Collective(kind, f"{func.namespace}.{name}", ranks, buffer,
                                     _ring_wire_bytes(kind, buffer, len(ranks))))
        return out


def summarize(calls: list[Collective]) -> list[dict]:
    """Per (kind, group size): the calls and their bytes."""
    rows: dict[tuple[str, int], dict] = {}
    for c in calls:
        row = rows.setdefault((c.kind, len(c.group_ranks)), {"kind": c.kind, "group_size": len(c.group_ranks),
                                                              "calls": 0, "buffer_bytes": 0, "wire_bytes": 0})
        row["calls"] += 1
        row["buffer_bytes"] += c.buffer_bytes
        row["wire_bytes"] += c.wire_bytes
    return sorted(rows.values(), key=lambda r: (r["kind"], r["group_size"]))
