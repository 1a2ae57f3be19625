"""The layout planner: `FSDP2Config(shard_size="auto")` -> the cheapest layout whose estimated peak
fits the memory budget per rank, decided before anything is allocated.

A layout is (shard size S, `reshard_after_forward`, what happens to activations (kept; checkpointed
every other layer or every layer: `activation_checkpointing`, `checkpoint_every`; or, on an
accelerator, `activation_offload` to the host), `cpu_offload`); with
S < world the ranks form world/S HSDP replicas, and S=1 is DDP-like replication (gradients are
all-reduced, no weight is all-gathered over the network). Each knob buys memory at a price, and the
planner escalates the cheapest first: a wider shard group costs only all-gather bandwidth,
resharding after forward a second all-gather in backward, activation checkpointing about a third
more compute, offload host-device copies and an optimizer step on the CPU. So candidates are tried
in the order (offload, parallelism, checkpointing, reshard, S) and the first that fits wins. What happens to
activations comes from their planner cost (memory.activation_choices), in its cost order: kept, checkpointed
(op-level, every other layer, every layer), each followed by itself with the loss computed in tiles along the
sequence when a rank holds more than one tile (no recomputation: the same cost, so after the untiled one), the
leanest checkpointing with the MLPs tiled too (their forward recomputed), then offload; the chosen tiles are set
in the config the plan returns, and a table's `tiles` column and a layout's description name them. Every candidate is
costed by the same estimator `hf-fsdp2 estimate-memory` uses (memory.py, checked byte for byte
against real ranks), on a meta copy of the model built once.

Tensor and context parallelism (TP, CP) are tried when FSDP alone does not fit, before CPU offload:
context parallelism first (each rank holds seq / cp tokens: activations divide by cp; K/V blocks
pass around the ring, overlapped with attention), then tensor parallelism (each rank holds 1/tp of
the split weights and of the heads' and MLP features' activations, at the price of an all-reduce of
the activations per layer pair in forward and backward, on the critical path), then both. `hf-fsdp2
plan` offers every TP size that divides the world and the model's heads (when its config has a TP
plan, one machine's 8 devices at most) and every CP size that divides the world and half the
sequence; `shard_size="auto"` keeps the TP and CP sizes of the run (its mesh decides them).

The default budget keeps a documented margin for what the estimate does not count: on CUDA 0.85 x
the device's memory (the CUDA context, NCCL buffers, the caching allocator's fragmentation); on CPU
0.75 x the machine's RAM shared by the local ranks (the Python process, libraries and the data
pipeline, which live in the same RAM).
"""

from __future__ import annotations

import logging
import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from ..config import FSDP2Config
from ..sharding.model_parts import ModelParts
from .memory import (ActivationChoice, MemoryEstimate, MetaTrainingModel, ParallelChoice, activation_choices,
                     kept_parallel_sizes, offload_choices, parallel_choice, parallel_choices, parallel_sizes,
                     parallel_sizes_words, prepare_meta_model, shard_size_allowed)
from .memory_report import format_bytes

CUDA_BUDGET_FRACTION = 0.85
CPU_BUDGET_FRACTION = 0.75
DEFAULT_PLAN_SEQ_LEN = 2048

logger = logging.getLogger("hf_fsdp2")


@dataclass(frozen=True)
class Candidate:
    shard_size: int  # data-parallel ranks FSDP2 shards over (a model-parallel split's shard multiple included)
    replicate_size: int
    reshard_after_forward: bool
    activations: ActivationChoice  # what happens to activations (memory.activation_choices): its settings read as
    cpu_offload: bool  # attributes of the candidate, e.g. `candidate.checkpoint_every`
    estimate: MemoryEstimate
    needed_bytes: int  # what must fit the budget: the device peak (on CPU: device + host, one RAM, + glibc's heap)
    host_bytes: int  # offloaded state in host memory (CUDA only)
    fits: bool
    parallel: ParallelChoice = parallel_choice()  # the model-parallel split (memory.parallel_choices): its
    # settings read as attributes of the candidate too
    # On CPU: glibc gives freed blocks back to the OS (runtime/host_allocator.py), so what a step frees is not
    # counted in `needed_bytes`; about 0.6x speed, dearer than any layout (docs/planner.md).
    returns_freed_memory: bool = False

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("activations", "parallel"):  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        for choice in (self.activations, self.parallel):
            try:
                return choice.setting(name)
            except KeyError:
                pass
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def describe(self) -> str:
        layout = (f"shard_size={self.shard_size}" if self.replicate_size == 1
                  else f"shard_size={self.shard_size} x {self.replicate_size} replicas")
        layout += self.parallel.description
        return (f"{layout}, reshard_after_forward={self.reshard_after_forward}, {self.activations.description}"
                + f", cpu_offload={self.cpu_offload}"
                + (", freed memory returned to the OS" if self.returns_freed_memory else ""))


@dataclass(frozen=True)
class LayoutPlan:
    world_size: int
    device_type: str
    budget_bytes: int
    budget_source: str
    host_budget_bytes: int | None
    batch_size: int
    seq_len: int
    candidates: tuple[Candidate, ...]  # in cost order

    @property
    def chosen(self) -> Candidate | None:
        return next((c for c in self.candidates if c.fits), None)

    @property
    def smallest_workable_budget(self) -> int:
        """The least budget under which some candidate would fit."""
        return min(c.needed_bytes for c in self.candidates)

    @property
    def returns_freed_memory(self) -> bool:
        """On CPU: whether the chosen candidate needs glibc to give freed blocks back to the OS to keep the
        budget (runtime/host_allocator.py): costed as a candidate after every layout that fits without it."""
        return self.chosen is not None and self.chosen.returns_freed_memory

    def config(self, base: FSDP2Config) -> FSDP2Config:
        """`base` with the chosen layout; raises naming the smallest budget that would work."""
        chosen = self.chosen
        if chosen is None:
            raise ValueError(self.failure())
        return base.replace(shard_size=chosen.shard_size, replicate_size=chosen.replicate_size,
                            **dict(chosen.parallel.settings), reshard_after_forward=chosen.reshard_after_forward,
                            **dict(chosen.activations.settings), cpu_offload=chosen.cpu_offload, memory_budget=None)

    def failure(self) -> str:
        leanest = min(self.candidates, key=lambda c: c.needed_bytes)
        return (f"shard_size='auto': no layout fits `memory_budget`={format_bytes(self.budget_bytes)} per rank "
                f"({self.budget_source}) on {self.world_size} ranks for batch {self.batch_size} x seq "
                f"{self.seq_len}; the leanest ({leanest.describe()}) needs {format_bytes(leanest.needed_bytes)}. "
                f"The smallest budget that works is {format_bytes(self.smallest_workable_budget)}: raise "
                f"`memory_budget` to it, add ranks, or plan for a smaller micro-batch (`plan_batch_size`, "
                f"`plan_seq_len`).")

    def summary(self) -> str:
        """One paragraph for the log: the decision and its numbers."""
        chosen = self.chosen
        head = (f"hf_fsdp2 auto layout on {self.world_size} ranks ({self.device_type}), budget "
                f"{format_bytes(self.budget_bytes)} per rank ({self.budget_source}), micro-batch "
                f"{self.batch_size} x {self.seq_len}: ")
        if chosen is None:
            return head + "nothing fits. " + self.failure()
        index = self.candidates.index(chosen)
        skipped = ""
        if index:  # the one closest to fitting says how far off the cheaper ones are (hf-fsdp2 plan lists them all)
            closest = min(self.candidates[:index], key=lambda c: c.needed_bytes)
            skipped = (f"; the {index} cheaper ones need more, the leanest of them {closest.describe()}: "
                       f"{format_bytes(closest.needed_bytes)}")
        return (head + f"{chosen.describe()}, estimated peak {format_bytes(chosen.needed_bytes)} "
                f"(candidate {index + 1} of {len(self.candidates)} in cost order{skipped})" + self._heap_note())

    def _heap_note(self) -> str:
        if not self.returns_freed_memory:
            return ""
        step = self.chosen.estimate.heap_kept_bytes
        return (f". On CPU glibc's heap may keep the {format_bytes(step)} of blocks under 32 MiB (gathered parameters, "
                f"gradient buffers, activations) each step frees, and no layout fits the budget with them: freed blocks over 128 KiB are given back to the OS, process-wide, "
                f"until this model is garbage-collected or hf_fsdp2.unregister(): every large allocation of the process, "
                f"the training loop's and yours, then pays a page fault per fresh page (about 0.6x speed for these steps "
                f"here; runtime/host_allocator.py)")

    def format_table(self) -> str:
        chosen = self.chosen
        lines = [f"budget {format_bytes(self.budget_bytes)} per rank ({self.budget_source}); {self.world_size} "
                 f"ranks on {self.device_type}; micro-batch {self.batch_size} x {self.seq_len} per rank",
                 f"{'#':>3}  {'shard x repl':>12}  {'tp x cp':>7}  {'reshard':>7}  {'AC':>5}  {'tiles':>18}  "
                 f"{'offload':>7}  {'peak/rank':>12}  {'host/rank':>10}  fits" + (f"  {'freed':>5}" if self.device_type == "cpu" else "")]
        for i, c in enumerate(self.candidates, 1):
            mark = "  <- chosen" if c is chosen else ""
            lines.append(f"{i:>3}  {f'{c.shard_size} x {c.replicate_size}':>12}  {c.parallel.mark:>7}  "
                         f"{str(c.reshard_after_forward):>7}  "
                         f"{c.activations.label:>5}  {c.activations.tiles:>18}  {str(c.cpu_offload):>7}  "
                         f"{format_bytes(c.needed_bytes):>12}  {format_bytes(c.host_bytes) if c.host_bytes else '-':>10}  "
                         f"{'yes' if c.fits else 'no':>4}"
                         + (f"  {'to OS' if c.returns_freed_memory else 'heap':>5}" if self.device_type == "cpu" else "")
                         + mark)
        lines.append(f"chosen: {chosen.describe()}{self._heap_note()}" if chosen else self.failure())
        return "\n".join(lines)


def default_budget(device_type: str, local_world_size: int) -> tuple[int, str]:
    """(bytes, how they were found) for one rank."""
    if device_type == "cuda":
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        return int(total * CUDA_BUDGET_FRACTION), f"{CUDA_BUDGET_FRACTION} x {format_bytes(total)} of GPU memory"
    total = host_memory()
    return (int(total * CPU_BUDGET_FRACTION / local_world_size),
            f"{CPU_BUDGET_FRACTION} x {format_bytes(total)} of RAM / {local_world_size} local ranks")


def host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def divisors(n: int) -> list[int]:
    """The divisors of `n`, ascending, in O(sqrt(n))."""
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def plan_seq_len(base: nn.Module | Any, config: FSDP2Config) -> int:
    """The tokens per sequence the auto layout plans for; `base`: a transformers model or its config."""
    if config.plan_seq_len is not None:
        return config.plan_seq_len
    hf_config = getattr(base, "config", base) if isinstance(base, nn.Module) else base
    text = getattr(hf_config, "get_text_config", lambda: hf_config)()
    positions = getattr(text, "max_position_embeddings", None)
    return min(DEFAULT_PLAN_SEQ_LEN, positions) if isinstance(positions, int) and positions > 0 else DEFAULT_PLAN_SEQ_LEN


def plan_layout(prepared: MetaTrainingModel, world_size: int, config: FSDP2Config, *, budget_bytes: int,
                budget_source: str = "memory_budget", device_type: str = "cuda", host_budget_bytes: int | None = None,
                batch_size: int = 1, seq_len: int = DEFAULT_PLAN_SEQ_LEN, checkpointing_fixed: bool = False,
                tp_sizes=(1,), cp_sizes=(1,), mesh_shape: tuple[int, int] | None = None) -> LayoutPlan:
    """Cost every candidate layout of `prepared` on `world_size` ranks, in cost order. `config`: the
    rest of the setup (dtypes, wrapping, prefetch); its True `activation_checkpointing` /
    `cpu_offload` are kept (as is checkpointing when the layers are already wrapped:
    `checkpointing_fixed`). On CPU, offload moves nothing off the device, so it is not a candidate.
    `tp_sizes` / `cp_sizes`: the model-parallel sizes to cost, handed to memory.parallel_choices (`parallel_sizes`
    lists the workable ones); `mesh_shape`: (replicate, shard) when a given mesh fixes them. Tiles along the sequence are
    tried as memory.activation_choices lists them for `seq_len` (tiles `config` sets are kept)."""
    offloads = offload_choices(config, device_type)  # their planner cost's: what the settings allow
    # their planner cost's list, per model-parallel split: what may be tiled along the sequence depends on it
    splits = parallel_choices(world_size, tp_sizes, cp_sizes)
    activations = {split: activation_choices(config, device_type, fixed=checkpointing_fixed, prepared=prepared,
                                             seq_len=seq_len, **dict(split.settings))
                   for split in splits}
    layouts = [(offload, split, choice, reshard, shard)
               for offload in offloads for split in splits
               for choice in activations[split] for reshard in (False, True)
               for shard in _shard_sizes(world_size // split.group_ranks, split.shard_multiple, mesh_shape)
               if shard_size_allowed(config, shard, world_size // split.group_ranks)]
    candidates = []
    for offload, split, choice, reshard, shard in layouts:
        replicate = world_size // split.group_ranks // shard
        layout = config.replace(shard_size=shard, replicate_size=replicate, **dict(split.settings), memory_budget=None,
                                reshard_after_forward=reshard, **dict(choice.settings), cpu_offload=offload)
        estimate = prepared.estimate(world_size, layout, batch_size=batch_size, seq_len=seq_len)
        if estimate.activations is None:
            raise ValueError(f"shard_size='auto' cannot plan {estimate.model_type}: its activations "
                             f"could not be estimated ({estimate.activations_error}); set the layout "
                             "(shard_size, reshard_after_forward, ...) yourself.")
        host = estimate.host_bytes if device_type != "cpu" else 0
        needed = estimate.device_bytes + (estimate.host_bytes if device_type == "cpu" else 0)
        fits = needed <= budget_bytes and (host_budget_bytes is None or host <= host_budget_bytes)
        candidates.append(Candidate(shard, replicate, reshard, choice, offload, estimate, needed, host, fits, split))
    if device_type == "cpu":
        candidates = _costed_heap(candidates, budget_bytes)
    if not candidates:
        raise ValueError(f"no layout to plan: the mesh shape {mesh_shape} (replicate, shard) does not fit "
                         f"{world_size} ranks with {parallel_sizes_words(tp_sizes, cp_sizes)}.")
    return LayoutPlan(world_size=world_size, device_type=device_type, budget_bytes=budget_bytes,
                      budget_source=budget_source, host_budget_bytes=host_budget_bytes, batch_size=batch_size,
                      seq_len=seq_len, candidates=tuple(candidates))


def _costed_heap(candidates: list[Candidate], budget_bytes: int) -> list[Candidate]:
    """On CPU, glibc's heap may keep what a step frees in blocks it serves from the heap (gathered parameters,
    gradient and reduce-scatter buffers, activations under 32 MiB: `heap_kept_bytes`; measured at a 1B LoRA on 2
    ranks: 1.45 GiB free in the heap at the RSS peak against 1.50 GiB counted) on top of the peak, so each layout needs its peak plus that; or, as a
    dearer candidate after every layout, its peak alone with freed blocks given back to the OS
    (runtime/host_allocator.py: about 0.6x speed, measured at 58M on 2 ranks, where whole-layer checkpointing
    costs 0.78x). So a checkpointed layout that fits with glibc's heap wins over an unchecked one that would
    need the lever (issue 51: the lever used to be chosen after the layout)."""
    kept = [dataclasses.replace(c, needed_bytes=c.needed_bytes + c.estimate.heap_kept_bytes,
                                fits=c.needed_bytes + c.estimate.heap_kept_bytes <= budget_bytes) for c in candidates]
    returned = [dataclasses.replace(c, returns_freed_memory=True) for c in candidates if c.estimate.heap_kept_bytes]
    return kept + returned


def _shard_sizes(dp: int, multiple: int, mesh_shape: tuple[int, int] | None) -> list[int]:
    """FSDP2's shard sizes over `dp` data-parallel ranks, each a `multiple` (a split's ranks part of each shard
    group: CP's)."""
    if mesh_shape is not None:
        return [mesh_shape[1]] if mesh_shape[0] * mesh_shape[1] == dp and mesh_shape[1] % multiple == 0 else []
    return [s for s in divisors(dp) if s % multiple == 0]


def resolve_auto_layout(model: nn.Module | ModelParts, config: FSDP2Config, *,
                        mesh_shape: tuple[int, int] | None = None) -> tuple[FSDP2Config, LayoutPlan | None]:
    """`config` with `shard_size="auto"` resolved for `model` on this process group (else unchanged), and the plan
    that chose it (None when there was nothing to resolve).

    Every rank computes the same plan from the same model; a default budget is agreed on (the
    smallest over ranks) first. The run's `tp_size` and `cp_size` are kept; `mesh_shape` (replicate,
    shard): the data-parallel shape of a mesh already built (Accelerate's, with TP or CP), kept too. The decision is
    logged on rank 0; hf_fsdp2/shard.py keeps the plan in the model's record (its `layout`). `model`: a model, or
    the parts an entry made (the meta copy is of both).
    Collective when the budget is the default: call on every rank.
    """
    if not config.is_auto_layout:
        return config, None
    module = model.model if isinstance(model, ModelParts) else model
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from ..runtime import collectives, host_allocator
    from ..runtime.distributed import device_type as current_device_type, local_world_size

    world = collectives.world_size()
    device = current_device_type()
    local_world = local_world_size(world)
    if config.memory_budget is not None:
        budget, source = config.memory_budget, "memory_budget"
    else:
        budget, source = default_budget(device, local_world)
        agreed = collectives.all_reduce_int(budget, "min")  # the same decision on every rank, even on unequal devices
        if agreed != budget:
            budget, source = agreed, source + ", the smallest over ranks"
    host_budget = int(host_memory() * CPU_BUDGET_FRACTION / local_world) if device == "cuda" else None
    prepared = prepare_meta_model(model, config)
    plan = plan_layout(prepared, world, config, budget_bytes=budget, budget_source=source, device_type=device,
                       host_budget_bytes=host_budget, batch_size=config.plan_batch_size,
                       seq_len=plan_seq_len(prepared.base, config),
                       checkpointing_fixed=any(isinstance(m, CheckpointWrapper) for m in module.modules()),
                       **kept_parallel_sizes(config), mesh_shape=mesh_shape)
    if plan.returns_freed_memory and not host_allocator.return_freed_blocks(module) and collectives.rank() == 0:
        logger.warning("hf_fsdp2: the C library is not glibc; its freed memory may keep RSS over the budget.")
    if collectives.rank() == 0:
        logger.warning(plan.summary())
    return plan.config(config), plan


__all__ = ["Candidate", "LayoutPlan", "default_budget", "parallel_sizes", "plan_layout", "resolve_auto_layout"]
