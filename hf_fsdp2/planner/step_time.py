"""A **predicted** step time for an N-rank job from one rank's measured compute and the collectives it issued
(tools/simulate.py): a model, not a run. Its assumptions, each printed with the prediction:

- Bandwidth per GPU is the given bus bandwidth (nccl-tests' `busbw`): inside a node (NVLink) for a group whose
  ranks all sit on one node of `gpus_per_node`, across nodes (the NIC) for any group that spans nodes; a
  collective takes `latency + wire bytes / bandwidth` (wire bytes by the ring algorithm,
  tools/collective_tally.py).
- FSDP2 overlaps its all-gathers and reduce-scatters with compute (it prefetches the next group's all-gather
  in forward and backward; reduce-scatters run on their own stream): only the step's first all-gather (nothing
  to hide behind) and its last reduce-scatter (nothing left to compute) are exposed, and the rest once it
  exceeds the compute it hides behind.
- All-to-alls (expert parallelism) and all-reduces (HSDP's replicas, host flags) are exposed whole: the
  experts wait for their tokens; the replicas' all-reduce follows the last reduce-scatter.
- Communication slows no kernel (NCCL's kernels share the SMs in reality) and every rank is as fast as this
  one (no straggler; balanced routing for MoE).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterable

# The defaults' sources, printed beside every prediction (assumptions, not measurements).
DEFAULT_INTRA_NODE_GBPS = 360.0
DEFAULT_INTER_NODE_GBPS = 40.0
DEFAULT_LATENCY_US = 15.0
DEFAULT_GPUS_PER_NODE = 8
DEFAULT_SOURCES = (
    "intra-node 360 GB/s: 80% of NVLink 4's 450 GB/s per direction per GPU (H100/H200 SXM, NVIDIA's "
    "datasheet); inter-node 40 GB/s: 80% of one 400 Gb/s NIC per GPU (8 x NDR InfiniBand per node, DGX H100); "
    "15 us per collective. Assumed: measure yours with nccl-tests and pass --intra-node-gbps / --inter-node-gbps."
)


@dataclass(frozen=True)
class Interconnect:
    intra_node_gbps: float = DEFAULT_INTRA_NODE_GBPS  # GB/s = 1e9 bytes/s
    inter_node_gbps: float = DEFAULT_INTER_NODE_GBPS
    latency_us: float = DEFAULT_LATENCY_US
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE
    source: str = DEFAULT_SOURCES

    def __post_init__(self):
        for name in ("intra_node_gbps", "inter_node_gbps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"`{name}`={getattr(self, name)!r} must be a positive bandwidth in GB/s.")
        if self.latency_us < 0:
            raise ValueError(f"`latency_us`={self.latency_us!r} must not be negative.")
        if self.gpus_per_node < 1:
            raise ValueError(f"`gpus_per_node`={self.gpus_per_node!r} must be a positive integer.")

    def seconds(self, wire_bytes: int, group_ranks: Iterable[int]) -> float:
        ranks = tuple(group_ranks)
        if len(ranks) <= 1:
            return 0.0
        spans_nodes = len({r // self.gpus_per_node for r in ranks}) > 1
        bandwidth = (self.inter_node_gbps if spans_nodes else self.intra_node_gbps) * 1e9
        return self.latency_us * 1e-6 + wire_bytes / bandwidth


@dataclass(frozen=True)
class StepPrediction:
    """PREDICTED, not measured: see the module docstring for what it assumes."""

    compute_s: float  # measured on this device, collectives doing no work
    overlapped_comm_s: float  # all-gathers and reduce-scatters FSDP2 can hide behind compute
    exposed_comm_s: float  # what the step waits for
    step_s: float
    tokens_per_step_per_gpu: float
    tokens_per_s_per_gpu: float
    interconnect: dict

    def to_dict(self) -> dict:
        return {"label": "predicted (a model, not a run)", **asdict(self)}


def predict_step(compute_s: float, calls: list, *, tokens_per_step_per_gpu: float,
                 interconnect: Interconnect | None = None) -> StepPrediction:
    """`calls`: one step's `Collective`s in issue order (tools/collective_tally.py)."""
    link = interconnect or Interconnect()
    gathers = [c for c in calls if c.kind == "all_gather" and len(c.group_ranks) > 1]
    scatters = [c for c in calls if c.kind == "reduce_scatter" and len(c.group_ranks) > 1]
    exposed = sum(link.seconds(c.wire_bytes, c.group_ranks) for c in calls if c.kind not in ("all_gather",
                                                                                           "reduce_scatter"))
    exposed += sum(link.seconds(c.wire_bytes, c.group_ranks) for c in gathers[:1] + scatters[-1:])
    hidden = sum(link.seconds(c.wire_bytes, c.group_ranks) for c in gathers[1:] + scatters[:-1])
    exposed += max(0.0, hidden - compute_s)
    step = compute_s + exposed
    return StepPrediction(compute_s=compute_s, overlapped_comm_s=min(hidden, compute_s), exposed_comm_s=exposed,
                          step_s=step, tokens_per_step_per_gpu=tokens_per_step_per_gpu,
                          tokens_per_s_per_gpu=tokens_per_step_per_gpu / step if step > 0 else 0.0,
                          interconnect=asdict(link))
