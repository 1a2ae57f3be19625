"""Token dispatch for expert parallelism with no device-to-host read per MoE layer (issue 64).

transformers' `AllToAllEP` (transformers/distributed/expert_parallel.py) sends each (token, expert) pair to its
expert's rank with an uneven all-to-all whose split sizes it reads back to the host every layer (`.tolist()`: on a
GPU a device sync per MoE layer, no CUDA graph). Here every collective has a size known on the host without
reading the router's choices, so the routing is dropless and stays on the device:

- each rank's tokens, expert ids and router weights are all-gathered over the EP group (torch's functional
  `all_gather_single`, differentiable: its backward reduce-scatters the gradients), in blocks of T_max + 1 rows,
  T_max the largest token count of the group (its ranks may hold batches of different lengths; padded rows are
  zero and pick no expert; the one more, always padding, is the zero row the unused pair rows read).
  T_max is exchanged as a host integer over a gloo group (`_HOST`), a CPU tensor that never was on the device: one
  small host collective per layer call, no device read.
- each rank takes the (token, expert) pairs of its own experts, sorted by expert: a fixed number of them, ep x T_max
  x min(top_k, local experts) (a token picks distinct experts), the unused ones sorted last with transformers' EP
  sentinel (local id E/ep); the grouped matmuls (`offs` on the device) skip those rows (`grouped_experts`).
- each pair's output is weighted by its router weight and summed into its token's row, and the rows are
  reduce-scattered back to the ranks that hold the tokens (`reduce_scatter_single`; backward: an all-gather): the
  token's sum over its top-k as `grouped_mm_experts_forward` weights then sums it (two terms add in either order
  to the same float; with top-k above 2 spread over ranks the order of the sum differs from one process's).

Why gathers and not the fixed-size all-to-all this module first had (blocks of T_max x min(top_k, local) pairs to
every rank): a token travels once to each rank instead of once per pair, so the bytes are ep x T_max rows each way
instead of ep x T_max x min(top_k, local); with top_k >= ep that is no more than the uneven all-to-all's T x top_k
(benchmarks/moe_bench.py: transformers' AllToAllEP side by side, and the numbers in benchmarks/README.md). The cost
left is the fixed pair count: the experts' gathers and elementwise passes run over ep x T_max x min(top_k, local)
rows (the grouped matmuls only over the used ones). Where the device has symmetric memory (all_to_all_vdev) an
uneven exchange with device-side splits would avoid it: not done. At ep 4 on CPU that fixed count (4x the used rows
at top-2 with 4 local experts: the gate's and the gathers' passes, ~20 ms more of one layer's forward and backward
than AllToAllEP's at moe_bench's shape, one thread) and twice the bytes are why AllToAllEP is faster there; one
packed all-gather of tokens, ids and weights (7 collectives a layer to 4) changed nothing measurable: not kept.

LoRA on the experts (PEFT's `target_parameters`) runs inside the grouped matmuls where the experts run here
(`adapters`, set by sharding/expert_parallel/lora.py around the call): x @ W + (x @ A) @ (scaling B) per expert group.

The implementation registers in transformers' `EPImplementationInterface` (its documented extension point) as
`NAME`, and `apply_expert_parallelism(..., ep_implementation=NAME)` installs it; sharding/expert_parallel/ picks
it, or transformers' `all_to_all` where `set_dispatch("all_to_all")` asks (benchmarks/moe_bench.py's side-by-side).

Refused by name (`refuse_unsupported`): a capacity factor in the model's config (this dispatch is dropless; a
capacity would drop tokens the router chose) and an experts implementation not known to skip the EP sentinel rows
(e.g. "sonicmoe"; "deepgemm_megamoe", which exchanges the tokens inside its kernel; "eager", the models' own
loops, not all of which skip it). With "grouped_mm" (transformers' default) the experts run in `grouped_experts`
on the sorted rows; "batched_mm" and "deepgemm" run in the experts' own forward.
"""

from __future__ import annotations

import contextlib
import functools
import weakref

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ...runtime import collectives, upstream

NAME = "hf_fsdp2_even_gather_scatter"
# torch's differentiable functional collectives (backward: the other one of the pair): `all_gather_single` /
# `reduce_scatter_single` in torch 2.13, `all_gather_tensor_autograd` / `reduce_scatter_tensor_autograd` in 2.11 (the
# GPU image's; deprecated aliases of the new names since)
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor_autograd
_reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor_autograd
REGISTRY = "transformers.distributed.expert_parallel.EPImplementationInterface._global_mapping"
DISPATCHES = {"even": NAME, "all_to_all": "all_to_all"}  # ours, and transformers' AllToAllEP (the benchmark's baseline)
# transformers' experts implementations that skip the rows a split experts module does not hold (local id
# `num_experts`, transformers' EP sentinel; integrations/moe.py, deepgemm.py). Not "eager", the model's own loop:
# some skip it (Qwen3-MoE's one_hot has num_experts + 1 classes), gpt-oss's fails on it (and reads the host anyway)
SENTINEL_AWARE = ("grouped_mm", "batched_mm", "deepgemm")
# config fields of routers that drop tokens past a capacity (Switch Transformers, NLLB-MoE)
CAPACITY_FIELDS = ("expert_capacity", "capacity_factor", "moe_eval_capacity_token_fraction")
_dispatch = "even"
# experts modules this dispatch runs (one GatherScatterEP each), and the LoRA terms of the call in progress of those
# whose adapters run inside the grouped matmuls (`adapters`: set by sharding/expert_parallel/lora.py around the EP forward)
_OURS: weakref.WeakSet = weakref.WeakSet()
_ADAPTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# experts whose projections another module multiplies (`use_matmul`): experts -> (matmul, the setting that asked)
_MATMULS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

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


def refuse_unsupported(config, ep_size: int, experts: dict | None = None) -> None:
    """MoE settings this dispatch cannot honour, refused by name (module docstring); `experts`: {name: the experts
    module EP splits}, each of which must run transformers' experts implementations (`use_experts_implementation`:
    the `experts_implementation` setting reaches it; a class with a loop of its own, e.g. Step3p7Experts, reads the
    host in it and ignores the setting)."""
    if config.model_type != "dots3_note":  # there `capacity_factor` is read as its top-k (num_experts_per_tok)
        for field in CAPACITY_FIELDS:
            if getattr(config, field, None) is not None:
                raise ValueError(f"`{field}`={getattr(config, field)!r} in the model's config with `ep_size`={ep_size}: "
                                 "expert parallelism in hf_fsdp2 is dropless (every token reaches every expert its "
                                 "router chose), a capacity would drop tokens; not done. Remove it from the config.")
    implementation = getattr(config, "_experts_implementation", None)
    own = [name for name, module in (experts or {}).items() if not hasattr(module, "has_gate")]
    if _dispatch == "even" and own:
        raise ValueError(f"expert parallelism (`ep_size`={ep_size}) with experts that do not run transformers' experts "
                         f"implementations ({type((experts or {})[own[0]]).__name__} at {own[0]}: a loop of its own, "
                         "which reads the host per layer and ignores `experts_implementation`) is not done in "
                         "hf_fsdp2's EP dispatch; transformers' AllToAllEP runs it: "
                         "hf_fsdp2.sharding.expert_parallel.dispatch.set_dispatch('all_to_all').")
    if _dispatch == "even" and implementation not in SENTINEL_AWARE:
        raise ValueError(f"`experts_implementation`={implementation!r} with `ep_size`={ep_size}: its experts are not "
                         "known to skip the rows another EP rank holds in hf_fsdp2's EP dispatch; not done. Use "
                         f"one of {', '.join(repr(n) for n in SENTINEL_AWARE)} (grouped_mm: transformers' default), "
                         "or transformers' AllToAllEP: hf_fsdp2.sharding.expert_parallel.dispatch.set_dispatch('all_to_all').")


def takes_adapters(experts) -> bool:
    """Whether this dispatch runs `experts` in `grouped_experts`, where LoRA goes inside the grouped matmuls
    (`adapters`); otherwise (transformers' AllToAllEP, or the experts' own batched_mm / deepgemm forward) the caller
    folds the adapters into the weights as PEFT does."""
    return experts in _OURS and experts.config._experts_implementation == "grouped_mm"


@contextlib.contextmanager
def adapters(experts, terms: dict):
    """For the calls of `experts` inside: LoRA `terms` ({parameter name: [(lhs, rhs, scaling), ...]}, the local
    experts' factors, `grouped_experts`) applied inside the grouped matmuls. Only where `takes_adapters(experts)`."""
    if not takes_adapters(experts):
        raise ValueError(f"LoRA inside the grouped matmuls of {type(experts).__name__}, which hf_fsdp2's EP dispatch "
                         "does not run with experts_implementation='grouped_mm'.")
    _ADAPTERS[experts] = terms
    try:
        yield
    finally:
        del _ADAPTERS[experts]


def use_matmul(experts, matmul, setting: str) -> None:
    """`matmul(rows, weight [E, in, out], offsets)` in place of transformers' `_grouped_mm` for the projections of
    `experts` in `grouped_experts` (not the LoRA terms), e.g. sharding/expert_parallel/low_precision.py's quantized
    grouped matmul; `setting` names what asked for it where it cannot run (another experts implementation)."""
    _MATMULS[experts] = (matmul, setting)


def local_pairs(expert_ids: torch.Tensor, rank: int, num_local: int, top_k: int, num_rows: int, unused_token: int):
    """This rank's share of the gathered routing (`expert_ids`: flat, token-major, every rank's tokens), on the device
    (no host read), as `num_rows` rows sorted by local expert: a fixed count known on the host, at least one more than
    the pairs whose expert this rank holds, the rows past them unused (local id `num_local`, transformers' EP sentinel).

    Returns each row's token (`unused_token` for an unused row), its local expert id, the grouped matmuls' `offs`
    (per-expert ends, int32), and for each (token, top-k slot) the row of its pair (`num_rows` - 1, an unused row,
    where the expert is another rank's)."""
    device, num_pairs = expert_ids.device, expert_ids.numel()
    local = expert_ids - rank * num_local
    local = torch.where((local >= 0) & (local < num_local), local, num_local)
    if num_rows > num_pairs:  # every pair may be this rank's (top_k <= local experts): unused rows past them
        local = F.pad(local, (0, num_rows - num_pairs), value=num_local)
    order = torch.argsort(local, stable=True)[:num_rows]
    ids = local.index_select(0, order)
    used = ids < num_local
    tokens = torch.where(used, torch.div(order, top_k, rounding_mode="floor"), unused_token)
    counts = torch.zeros(num_local + 1, dtype=torch.long, device=device).scatter_add_(0, local, torch.ones_like(local))
    rows = torch.full((num_pairs + 1,), num_rows - 1, dtype=torch.long, device=device).scatter_(
        0, torch.where(used, order, num_pairs), torch.arange(num_rows, device=device))
    return tokens, ids, torch.cumsum(counts[:num_local], 0, dtype=torch.int32), rows[:num_pairs]


def grouped_experts(experts, rows: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor,
                    adapters: dict | None = None) -> torch.Tensor:
    """`rows` (sorted by local expert `ids`, the sentinel rows last) through the local experts as transformers'
    `grouped_mm_experts_forward` computes them: its grouped matmul `_grouped_mm` (one per projection for all local
    experts, `offs` ending at the used rows, so the sentinel rows cost none), the experts' own gate or activation,
    biases, post-expert norm. Not that function itself: it sorts (token, top-k) routing, masks and weights it, where
    these rows come sorted, unweighted, and the sentinel rows are never read back (every pass here is row by row;
    a bias reaches used rows only, so no sentinel row's gradient reaches it).

    `adapters`: {parameter name: [(lhs, rhs, scaling), ...]}, LoRA on those parameters of the local experts, each
    term's delta `scaling * lhs @ rhs` in the parameter's own layout (PEFT's `ParamWrapper.get_delta_factors`,
    sliced to the local experts by sharding/expert_parallel/lora.py). Applied inside the grouped matmuls, never folded into a
    weight: x @ W + (x @ L1) @ (scaling L2) with two more grouped matmuls of rank r over the same `offs` (`_low_rank`;
    the scaling on the small factor, not on the rows: one pass over them, the sum), so no [experts, out, in] delta or
    its gradient exists, and a frozen W gets no gradient."""
    from transformers.integrations.moe import _grouped_mm

    adapters = adapters or {}

    def linear(x, name, bias):
        weight = getattr(experts, name)
        matmul = _MATMULS[experts][0] if experts in _MATMULS else _grouped_mm
        out = matmul(x, weight if experts.is_transposed else weight.transpose(-2, -1), offsets)
        for lhs, rhs, scaling in adapters.get(name, ()):
            out = out + _low_rank(x, lhs, rhs * scaling, experts.is_transposed, offsets)
        if bias is None:
            return out
        return out + torch.cat([bias, bias.new_zeros(1, bias.shape[-1])]).index_select(0, ids)

    bias = experts.has_bias
    if experts.has_gate:
        hidden = experts._apply_gate(linear(rows, "gate_up_proj", experts.gate_up_proj_bias if bias else None))
    else:
        hidden = experts.act_fn(linear(rows, "up_proj", experts.up_proj_bias if bias else None))
    out = linear(hidden, "down_proj", experts.down_proj_bias if bias else None)
    # transformers < 5.23 (the GPU image's 5.17) has no post-expert norm, nor the attribute
    return experts.post_expert_norm(out) if getattr(experts, "has_post_expert_norm", False) else out


def _low_rank(x: torch.Tensor, lhs: torch.Tensor, rhs: torch.Tensor, transposed: bool, offsets: torch.Tensor):
    """x @ delta_e (in the linear's orientation) for each row's expert, as (x @ down) @ up: a weight [E, in, out]
    (`is_transposed`) is read x @ W, so x @ (lhs @ rhs) = (x @ lhs) @ rhs; one [E, out, in] is read x @ W^T, so
    x @ (lhs @ rhs)^T = (x @ rhs^T) @ lhs^T. The rank is padded with zeros to a multiple of 16 bytes (CUDA's grouped
    matmul needs its operands' strides 16-byte aligned; the zero columns add nothing)."""
    from transformers.integrations.moe import _grouped_mm

    down, up = (lhs, rhs) if transposed else (rhs.transpose(-2, -1), lhs.transpose(-2, -1))  # [e, in, r], [e, r, out]
    align = max(1, 16 // down.element_size())
    pad = -down.shape[-1] % align
    if pad:
        down, up = F.pad(down, (0, pad)), F.pad(up, (0, 0, 0, pad))
    # PEFT's lora_B is [out, r * E] (expert minor): its per-expert slices are strided by expert, which the grouped
    # matmul refuses; a copy of r x (in + out) values per expert
    down, up = down.contiguous(), up.contiguous()
    return _grouped_mm(_grouped_mm(x, down, offsets), up, offsets)


@functools.cache
def _implementation() -> type:
    """The `EPImplementation` subclass (built on first use: transformers' EP module is imported only with ep_size)."""
    from transformers.distributed.expert_parallel import EPImplementation

    class GatherScatterEP(EPImplementation):
        """Every rank's tokens to every rank of the EP group, each rank's experts' weighted outputs summed back:
        no split size read back (module docstring)."""

        def __init__(self, experts, ep_mesh, tp_mesh):
            super().__init__(experts, ep_mesh, tp_mesh)
            if tp_mesh.size() > 1:
                raise ValueError(f"the EP dispatch {NAME} with tensor parallelism (tp_size={tp_mesh.size()}) is not "
                                 "done in hf_fsdp2.")
            self.experts = experts
            _OURS.add(experts)
            self.group = ep_mesh.get_group()
            self.host_group, self.host_tokens = _HOST[self.group]

        def max_tokens(self, num_tokens: int) -> int:
            """The EP group's largest token count: a host integer, all-reduced over the gloo host group."""
            if self.ep_mesh.size() == 1:
                return num_tokens
            self.host_tokens.fill_(num_tokens)
            dist.all_reduce(self.host_tokens, op=dist.ReduceOp.MAX, group=self.host_group)
            return int(self.host_tokens.tolist()[0])

        def experts_rows(self, x, ids, offsets):
            """The local experts' outputs of rows sorted by local expert (`ids`, sentinel rows last)."""
            if self.experts.config._experts_implementation == "grouped_mm":
                return grouped_experts(self.experts, x, ids, offsets, _ADAPTERS.get(self.experts))
            if self.experts in _MATMULS:  # set_experts_implementation after sharding: that matmul would not run
                raise ValueError(f"{_MATMULS[self.experts][1]} runs in the grouped_mm experts implementation, not "
                                 f"{self.experts.config._experts_implementation!r}; set it back to 'grouped_mm'.")
            # the experts' own implementation (batched_mm, deepgemm): top-1, unit weights, sentinel rows
            return self.experts_forward(x, ids.unsqueeze(-1), x.new_ones(x.shape[0], 1))

        def __call__(self, hidden_states, top_k_index, top_k_weights):
            num_tokens, hidden = hidden_states.shape
            top_k, ep_size, num_local = top_k_index.shape[-1], self.ep_mesh.size(), self.num_local_experts
            rows = self.max_tokens(num_tokens)
            if rows == 0:  # no rank holds a token: one zero row keeps the experts in backward (as AllToAllEP)
                zero = hidden_states.new_zeros(1, hidden)
                return self.experts_rows(zero, zero.new_full((1,), num_local, dtype=torch.long),
                                         torch.zeros(num_local, dtype=torch.int32, device=zero.device)
                                         )[:0] + hidden_states.sum() * 0
            # the gathers are even: each rank's block is the group's largest batch and one row more, always padding
            # (a zero token that picks no expert: the rows no pair uses read rank 0's, `unused_token`)
            block = rows + 1
            tokens, expert_ids, weights = self.gather(hidden_states, top_k_index, top_k_weights, block)
            unused_token = rows
            # a token picks distinct experts: at most min(top_k, local experts) of its pairs are this rank's; one
            # row more, always unused, is where the other ranks' pairs point
            num_rows = ep_size * rows * min(top_k, num_local) + 1
            row_tokens, ids, offsets, pair_rows = local_pairs(expert_ids, self.ep_mesh.get_local_rank(), num_local,
                                                              top_k, num_rows, unused_token)
            # each row's token (embedding: its backward adds the used rows' gradients only), a zero row for unused
            x = F.embedding(row_tokens, tokens, padding_idx=unused_token)
            out = self.experts_rows(x, ids, offsets)
            # each token's pairs on this rank weighted by the router and summed, as grouped_mm_experts_forward weights
            # and sums its top-k (in the weights' and outputs' common dtype, as its product): one embedding_bag, which
            # reads the used rows only (the unused row is its padding_idx)
            dtype = torch.promote_types(out.dtype, weights.dtype)
            partial = F.embedding_bag(pair_rows.view(-1, top_k), out.to(dtype), mode="sum",
                                      per_sample_weights=weights.to(dtype), padding_idx=num_rows - 1)
            out = _reduce_scatter(partial, "sum", 0, self.group)
            # not a view of it: FSDP2 warns on a module output that is one (in-place ops on it would skip its hook)
            return out[:num_tokens].clone()

        def gather(self, hidden_states, top_k_index, top_k_weights, block: int):
            """Every rank's tokens, expert ids (flat, token-major) and router weights, in blocks of `block` rows (the
            padded rows: zero tokens and weights, the expert id no rank holds)."""
            padding = block - hidden_states.shape[0]
            no_expert = self.num_local_experts * self.ep_mesh.size()  # a padded row's expert: no rank's
            return (_all_gather(F.pad(hidden_states, (0, 0, 0, padding)), 0, self.group),
                    _all_gather(F.pad(top_k_index, (0, 0, 0, padding), value=no_expert).reshape(-1), 0,
                                             self.group),
                    _all_gather(F.pad(top_k_weights, (0, 0, 0, padding)), 0, self.group))

    return GatherScatterEP


__all__ = ["DISPATCHES", "NAME", "adapters", "grouped_experts", "host_buffers", "implementation_name", "local_pairs",
           "prepare", "refuse_unsupported", "set_dispatch", "takes_adapters", "use_matmul"]
