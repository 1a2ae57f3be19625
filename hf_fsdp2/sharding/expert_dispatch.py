"""Token dispatch for expert parallelism with no device-to-host read per MoE layer (issue 64).

transformers' `AllToAllEP` (transformers/distributed/expert_parallel.py) sends each (token, expert) pair to its
expert's rank with an uneven all-to-all whose split sizes it reads back to the host every layer (`.tolist()`: on a
GPU a device sync per MoE layer, no CUDA graph). Here the all-to-alls are even: each rank sends every other rank a
block of a fixed number of rows, an upper bound known without reading the router's counts, so the routing is
dropless and stays on the device:

- block size C = T_max x min(top_k, local experts): T_max the largest token count of the EP group (its ranks may hold
  batches of different lengths). A token picks distinct experts, so at most min(top_k, E/ep) of its pairs go to
  one rank; T_max is exchanged as a host integer over a gloo group (`_HOST`), a CPU tensor that never was on
  the device: one small host collective per layer call, no device read.
- the sender sorts its pairs by expert, so the pairs for rank d are contiguous; their positions in d's block are
  computed on the device (a cumsum of per-rank counts), and the block's unused rows carry the local expert id
  E/ep, transformers' EP sentinel. A second even all-to-all (int64, one value a row) carries the local expert ids.
- the receiver runs its experts with transformers' own experts implementation (the model's
  `experts_implementation`; `grouped_mm` by default: one `torch.nn.functional.grouped_mm` per projection for
  all local experts, the sentinel rows sorted to the tail and skipped by the kernel, masked to zero after it).
- the outputs go back by the same even all-to-all; each pair's row is taken at its slot, weighted by the router's
  weight and summed over the top-k on the sender, as in one process (`grouped_mm_experts_forward` weights then sums).

The cost is the padding: ep x the rows of an uneven exchange cross the all-to-alls, and the experts' sort, gather
and elementwise passes run over ep x C rows (the grouped matmuls only over the real ones). benchmarks/moe_bench.py
measures it against `AllToAllEP` on CPU. Where the device has symmetric memory (all_to_all_vdev) an uneven
exchange with device-side splits would avoid it: not done.

The implementation registers in transformers' `EPImplementationInterface` (its documented extension point) as
`NAME`, and `apply_expert_parallelism(..., ep_implementation=NAME)` installs it; sharding/expert_parallel.py picks
it, or transformers' `all_to_all` where `set_dispatch("all_to_all")` asks (benchmarks/moe_bench.py's side-by-side).

Refused by name (`refuse_unsupported`): a capacity factor in the model's config (this dispatch is dropless; a
capacity would drop tokens the router chose) and an experts implementation not known to skip the EP sentinel rows
(e.g. "sonicmoe"; "deepgemm_megamoe", which exchanges the tokens inside its kernel; "eager", the models' own
loops, not all of which skip it).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..runtime import collectives, upstream

NAME = "hf_fsdp2_even_all_to_all"
REGISTRY = "transformers.distributed.expert_parallel.EPImplementationInterface._global_mapping"
DISPATCHES = {"even": NAME, "all_to_all": "all_to_all"}  # ours, and transformers' AllToAllEP (the benchmark's baseline)
# transformers' experts implementations that skip the rows a split experts module does not hold (local id
# `num_experts`, transformers' EP sentinel; integrations/moe.py, deepgemm.py). Not "eager", the model's own loop:
# some skip it (Qwen3-MoE's one_hot has num_experts + 1 classes), gpt-oss's fails on it (and reads the host anyway)
SENTINEL_AWARE = ("grouped_mm", "batched_mm", "deepgemm")
# config fields of routers that drop tokens past a capacity (Switch Transformers, NLLB-MoE)
CAPACITY_FIELDS = ("expert_capacity", "capacity_factor", "moe_eval_capacity_token_fraction")
_dispatch = "even"

# by the EP group: the gloo group over its ranks that carries the token counts, and the CPU tensor they are
# all-reduced in (one per group: its layers run one after another). Keyed by the group itself, not its name: ranks
# that are threads of one process (tools/local_ranks.py) have groups of the same names, one set per thread.
_HOST: dict[dist.ProcessGroup, tuple[dist.ProcessGroup, torch.Tensor]] = {}


def prepare(experts_mesh: DeviceMesh, ep_dim: str) -> None:
    """Register the implementation and make the host groups of `experts_mesh`'s `ep_dim` groups (collective: every
    rank calls it with the same mesh). On CPU the EP group is gloo already and carries the counts itself."""
    upstream.add_entries(REGISTRY, {NAME: _implementation()})
    ep_mesh = experts_mesh[ep_dim]
    if ep_mesh.device_type == "cpu":
        host = ep_mesh.get_group()
    else:  # an accelerator's group (NCCL) takes device tensors only: a gloo mesh over the same ranks (fake under
        # torch's fake group, `hf-fsdp2 simulate`: no gloo peer exists there), as runtime/collectives.py's host_group
        # (threaded under torch's threaded group, ranks as threads: tools/local_ranks.py)
        names, backend = experts_mesh.mesh_dim_names, collectives.in_process_backend() or "gloo"
        host_mesh = init_device_mesh("cpu", tuple(experts_mesh.shape), mesh_dim_names=names,
                                     backend_override={dim: backend for dim in range(len(names))})
        host = host_mesh[ep_dim].get_group()
    _HOST[ep_mesh.get_group()] = (host, torch.zeros(1, dtype=torch.long))  # on the CPU, never the device


def host_buffers() -> list[torch.Tensor]:
    """The CPU tensors the token counts are read from (tests/host_reads.py counts their reads apart)."""
    return [tensor for _, tensor in _HOST.values()]


def set_dispatch(name: str) -> None:
    """Which dispatch later `apply` calls install: "even" (this module, the default) or "all_to_all" (transformers'
    `AllToAllEP`, which reads split sizes to the host each layer): benchmarks/moe_bench.py runs both side by side."""
    global _dispatch
    if name not in DISPATCHES:
        raise ValueError(f"EP dispatch {name!r}: one of {', '.join(DISPATCHES)}.")
    _dispatch = name


def implementation_name() -> str:
    """The `ep_implementation` name transformers' `apply_expert_parallelism` is given."""
    return DISPATCHES[_dispatch]


def refuse_unsupported(config, ep_size: int) -> None:
    """MoE settings this dispatch cannot honour, refused by name (module docstring)."""
    if config.model_type != "dots3_note":  # there `capacity_factor` is read as its top-k (num_experts_per_tok)
        for field in CAPACITY_FIELDS:
            if getattr(config, field, None) is not None:
                raise ValueError(f"`{field}`={getattr(config, field)!r} in the model's config with `ep_size`={ep_size}: "
                                 "expert parallelism in hf_fsdp2 is dropless (every token reaches every expert its "
                                 "router chose), a capacity would drop tokens; not done. Remove it from the config.")
    implementation = getattr(config, "_experts_implementation", None)
    if _dispatch == "even" and implementation not in SENTINEL_AWARE:
        raise ValueError(f"`experts_implementation`={implementation!r} with `ep_size`={ep_size}: its experts are not "
                         "known to skip the rows another EP rank holds in hf_fsdp2's even all-to-all; not done. Use "
                         f"one of {', '.join(repr(n) for n in SENTINEL_AWARE)} (grouped_mm: transformers' default), "
                         "or transformers' AllToAllEP: hf_fsdp2.sharding.expert_dispatch.set_dispatch('all_to_all').")


def slots(expert_ids: torch.Tensor, num_local: int, ep_size: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For the flat (token x top-k) expert ids: each pair's row in the even send buffer (rank d's block at
    d x `block`, pairs sorted by expert within it), and the buffer's local expert ids (`num_local`, the sentinel,
    in unused rows). All on the device, no host read."""
    order = torch.argsort(expert_ids, stable=True)
    sorted_ids = expert_ids[order]
    dest = torch.div(sorted_ids, num_local, rounding_mode="floor")
    counts = torch.zeros(ep_size, dtype=torch.long, device=expert_ids.device).scatter_add_(
        0, dest, torch.ones_like(dest))
    starts = torch.cumsum(counts, 0) - counts
    sorted_slots = dest * block + torch.arange(sorted_ids.numel(), device=expert_ids.device) - starts[dest]
    pair_slots = torch.empty_like(sorted_slots).scatter_(0, order, sorted_slots)
    local_ids = torch.full((ep_size * block,), num_local, dtype=torch.long, device=expert_ids.device)
    local_ids.scatter_(0, sorted_slots, sorted_ids - dest * num_local)
    return pair_slots, local_ids


def _exchange(rows: torch.Tensor, group) -> torch.Tensor:
    """An even all-to-all (equal blocks to and from every rank of `group`) that autograd differentiates (its backward
    is the same exchange of the gradients): torch's functional `all_to_all_single_autograd`, as Ulysses uses it."""
    return funcol.all_to_all_single_autograd(rows.contiguous(), None, None, group)


@functools.cache
def _implementation() -> type:
    """The `EPImplementation` subclass (built on first use: transformers' EP module is imported only with ep_size)."""
    from transformers.distributed.expert_parallel import EPImplementation

    class EvenAllToAllEP(EPImplementation):
        """Every (token, expert) pair to its expert's rank in fixed-size blocks: no split size read back
        (module docstring)."""

        def __init__(self, experts, ep_mesh, tp_mesh):
            super().__init__(experts, ep_mesh, tp_mesh)
            if tp_mesh.size() > 1:
                raise ValueError(f"the even all-to-all EP dispatch ({NAME}) with tensor parallelism (tp_size="
                                 f"{tp_mesh.size()}) is not done in hf_fsdp2.")
            self.group = ep_mesh.get_group()
            self.host_group, self.host_tokens = _HOST[self.group]

        def max_tokens(self, num_tokens: int) -> int:
            """The EP group's largest token count: a host integer, all-reduced over the gloo host group."""
            if self.ep_mesh.size() == 1:
                return num_tokens
            self.host_tokens.fill_(num_tokens)
            dist.all_reduce(self.host_tokens, op=dist.ReduceOp.MAX, group=self.host_group)
            return int(self.host_tokens.tolist()[0])

        def __call__(self, hidden_states, top_k_index, top_k_weights):
            num_tokens, hidden = hidden_states.shape
            top_k, ep_size = top_k_index.shape[-1], self.ep_mesh.size()
            block = self.max_tokens(num_tokens) * min(top_k, self.num_local_experts)
            pair_slots, local_ids = slots(top_k_index.reshape(-1), self.num_local_experts, ep_size, block)
            send = hidden_states.new_zeros(ep_size * block, hidden).index_copy(
                0, pair_slots, hidden_states.repeat_interleave(top_k, dim=0))
            recv_ids = torch.empty_like(local_ids)
            dist.all_to_all_single(recv_ids, local_ids, group=self.group)
            recv = _exchange(send, self.group)
            # experts run top-1 with unit weights; the router's weights are applied on the sender, as AllToAllEP does
            if block == 0:  # no rank holds a token: one zero row keeps the experts in backward (as AllToAllEP)
                out = self.experts_forward(recv.sum(0, keepdim=True), recv_ids.new_zeros(1, 1), recv.new_ones(1, 1))[:0]
            else:
                out = self.experts_forward(recv, recv_ids.unsqueeze(-1), recv.new_ones(recv.shape[0], 1))
            back = _exchange(out.to(hidden_states.dtype), self.group)
            pairs = back.index_select(0, pair_slots).view(num_tokens, top_k, hidden)
            return (pairs * top_k_weights.unsqueeze(-1)).sum(dim=1)

    return EvenAllToAllEP


__all__ = ["DISPATCHES", "NAME", "host_buffers", "implementation_name", "prepare", "refuse_unsupported", "set_dispatch", "slots"]
