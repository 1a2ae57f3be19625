"""`hf-fsdp2 simulate`: one rank of an N-rank job, run in this process on this machine's device.

torch's fake process group (`init_process_group("fake", store=FakeStore(), rank=r, world_size=N)`,
torch/testing/_internal/distributed/fake_pg.py) makes this process rank `r` of `N`: every collective returns
at once and moves nothing, but every tensor has its real per-rank shape. The model is built on the meta
device from its config and sharded by `shard_model` (the route every launch takes after the config is read),
so only this rank's rows are ever allocated, initialised by the model's own init. Then real forward,
backward and AdamW steps on random tokens measure what one rank of the real job holds and computes:
CUDA's allocated and reserved peaks, the process's RSS and glibc heap peaks over their level before the
model, the step's compute time, and every collective with its bytes (tools/collective_tally.py). The
estimate for the same setup (planner/memory.py) is put beside the measurement, and a predicted step time
for a stated interconnect (planner/step_time.py) beside that, labelled as a prediction.

Context parallelism runs as a launch runs it: the mesh from Accelerate's own `ParallelismConfig`
(dp_replicate x dp_shard x cp, "dp_shard_cp" flattened), each step inside torch's `context_parallel` over its
"cp" dimension as `accelerator.maybe_context_parallel` enters it, labels shifted before the split.
What a fake group cannot give is refused by name: saving (rank 0 creates the files the others write)
and loss values (the gathered weights are whatever the buffers held: the loss is not reported).
"""

from __future__ import annotations

import contextlib
import gc
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from ..config import CP_DIM, FSDP2Config
from ..planner.meta_model import DEFAULT_LORA_TARGETS
from ..planner.step_time import Interconnect, predict_step
from ..runtime import collectives, memory_probe
from .collective_tally import Collective, CollectiveTally, summarize


@dataclass
class RankReport:
    """One simulated rank's measurement. Bytes are over the level before the model was built."""

    rank: int
    world_size: int
    device: str
    setup: str
    steps: int
    step_s: list[float]  # every step, the first included (it allocates the optimizer's states)
    compute_s: float  # the median of the steps between the first and the last (see _train)
    cuda_allocated_peak: int | None
    cuda_reserved_peak: int | None
    rss_peak: int
    heap_live_peak: int | None
    estimate_device_bytes: int
    estimate_heap_kept_bytes: int
    collectives: list[dict]
    prediction: dict
    notes: list[str] = field(default_factory=list)

    @property
    def measured_peak(self) -> int:
        """What the estimate's device peak is compared with: CUDA allocated, else the RSS."""
        return self.cuda_allocated_peak if self.cuda_allocated_peak is not None else self.rss_peak

    @property
    def estimate_ratio(self) -> float:
        return self.measured_peak / self.estimate_device_bytes if self.estimate_device_bytes else float("nan")

    @property
    def heap_ratio(self) -> float | None:
        """On the CPU, glibc's live bytes over the estimate: what the run holds, without the heap's free chunks
        that RSS also counts (bounded by the estimate's `heap_kept_bytes`)."""
        if self.heap_live_peak is None or self.cuda_allocated_peak is not None or not self.estimate_device_bytes:
            return None
        return self.heap_live_peak / self.estimate_device_bytes

    def to_dict(self) -> dict:
        return {**asdict(self), "measured_peak": self.measured_peak, "estimate_ratio": self.estimate_ratio,
                "heap_ratio": self.heap_ratio}


def refuse_unsimulated(config: FSDP2Config) -> None:
    """Settings the fake group cannot run, refused by name before anything is built."""
    if config.async_save:
        raise ValueError("`async_save`: simulate never saves (under the fake group rank 0 would create the files "
                         "the other ranks write); leave it off.")


def refuse_reducer(mesh, config: FSDP2Config) -> None:
    """A layout that trains on DDP's reducer (one-rank shard groups with replicas, as the auto layout picks when the
    model fits): the reducer requires its all-reduce's future to hold a tensor, and the fake group's holds none
    (an internal assert in torch's c10d/comm.cpp at the first backward). Refused by name before the model is built."""
    from ..sharding.replication import mesh_trains_on_reducer

    if mesh_trains_on_reducer(mesh, config):
        raise ValueError("the layout trains on DDP's reducer (`shard_size`=1 with `replicate_size`="
                         f"{config.replicate_size}, `replication`='ddp'), which torch's fake process group cannot run: "
                         "not done under simulate. Simulate FSDP2's one-rank groups instead "
                         "(FSDP2Config(replication='fsdp2'), hf-fsdp2 simulate --replication fsdp2), or a layout that shards.")


def context_parallel_mesh(config: FSDP2Config, world_size: int, device: str):
    """The mesh an Accelerate launch with `parallelism_config_cp_size` hands hf_fsdp2: Accelerate's own
    `ParallelismConfig.build_device_mesh` (dp_replicate x dp_shard x cp, with "dp_shard_cp" flattened for FSDP2),
    built under the fake group. An auto layout keeps its data-parallel shape as under Accelerate."""
    from accelerate.parallelism_config import ParallelismConfig

    if not config.is_auto_layout:
        replicate, shard = config.mesh_shape(world_size)  # the ranks beside tp; refuses a cp_size not dividing shard
    else:  # the planner keeps a given mesh's data-parallel shape: one shard group of the ranks beside tp
        replicate, shard = 1, world_size // config.tp_size
        if shard % config.cp_size:
            raise ValueError(f"`cp_size`={config.cp_size} must divide the shard size {shard}: FSDP2 shards over "
                             "dp_shard x cp.")
    return ParallelismConfig(dp_replicate_size=replicate, dp_shard_size=shard // config.cp_size,
                             cp_size=config.cp_size, tp_size=config.tp_size).build_device_mesh(device)


@contextlib.contextmanager
def fake_world(rank: int, world_size: int):
    """This process as rank `rank` of `world_size` under torch's fake process group, torn down after."""
    if dist.is_initialized():
        raise ValueError("a process group already exists in this process: simulate runs one rank in a process of "
                         "its own (the hf-fsdp2 simulate command forks one per rank).")
    if not 0 <= rank < world_size:
        raise ValueError(f"`rank`={rank} must be from 0 to `world_size` - 1 = {world_size - 1}.")
    # Importing the module registers torch's "fake" backend (dist.Backend.register_backend).
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        collectives.forget_host_groups()


def simulate_rank(
    model: Any,
    world_size: int,
    config: FSDP2Config | None = None,
    *,
    rank: int = 0,
    batch_size: int = 1,
    seq_len: int = 2048,
    steps: int = 3,
    dtype: torch.dtype | str | None = None,
    lora_r: int | None = None,
    lora_targets: Sequence[str] = DEFAULT_LORA_TARGETS,
    gradient_accumulation_steps: int = 1,
    interconnect: Interconnect | None = None,
    device: str | None = None,
    **quantization: Any,
) -> RankReport:
    """Train rank `rank` of a `world_size`-rank job for `steps` optimizer steps in this process (no process group
    may exist); `model`: a transformers config, a model directory or its config.json (random weights, this rank's
    rows only). Arguments as `estimate_memory`'s, whose estimate for the same setup the report carries;
    `quantization`: its quantization keywords (`load_in_4bit=True`: QLoRA, the model's own init drawn in float
    and quantized into each rank's rows, sharding/engine.py `_init_quantized_rows`)."""
    from ..planner.memory import estimate_memory, prepare_meta_model
    from ..shard import plan, shard_model

    config = config or FSDP2Config()
    refuse_unsimulated(config)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"`steps`={steps!r} must be a positive integer (the first step allocates the optimizer's "
                         "states; the ones after it are timed).")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda") or (device == "cuda" and not torch.cuda.is_available()):
        raise ValueError(f"`device`={device!r} must be 'cpu' or 'cuda' (with a GPU present).")
    with fake_world(rank, world_size):
        if device == "cpu" and torch.cuda.is_available():
            raise ValueError("`device`='cpu' on a machine with a GPU is not done: hf_fsdp2 shards onto the GPU under "
                             "the fake group, as it would under NCCL.")
        if device == "cuda":
            torch.cuda.set_device(0)
        # The meta model and its layout first (shard_size="auto" resolved as shard_model resolves it), then the
        # estimate for that layout: neither allocates a real tensor, so both stay out of the measurement.
        # The meta model the estimate costs (a quantized base quantized on meta and prepared as from_pretrained's).
        module = prepare_meta_model(model, config, dtype=dtype, lora_r=lora_r, lora_targets=lora_targets,
                                    **quantization).model
        # Ring CP alone: Accelerate's mesh, torch's context_parallel around each step. Ring CP x Ulysses is
        # hf_fsdp2's own mesh (build_mesh: dp_shard x cp x sp), each rank fed its part by local_batch.
        ring_only = config.cp_size > 1 and config.sp_size == 1
        mesh = context_parallel_mesh(config, world_size, device) if ring_only else None
        layout = plan(module, config, mesh=mesh)
        refuse_reducer(layout.mesh, layout.config)
        estimate = estimate_memory(model, world_size, layout.config, dtype=dtype, lora_r=lora_r,
                                   lora_targets=lora_targets, batch_size=batch_size, seq_len=seq_len,
                                   gradient_accumulation_steps=gradient_accumulation_steps, **quantization)
        gc.collect()
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        cuda_base = torch.cuda.memory_allocated() if device == "cuda" else 0
        reserved_base = torch.cuda.memory_reserved() if device == "cuda" else 0
        memory_probe.reset_hwm()
        rss_base = memory_probe.rss_bytes()
        heap = memory_probe.malloc_bytes()
        heap_base = heap["live"] if heap else None
        with memory_probe.RssSampler(malloc=heap is not None) as sampler:
            shard_model(module, layout.config, mesh=layout.mesh)
            step_s, last_step_calls, heap_peak_by_op = _train(module, layout.config, device, batch_size, seq_len, steps,
                                                    gradient_accumulation_steps, measure_heap=heap is not None,
                                                    cp_mesh=mesh[CP_DIM] if ring_only else None)
        if device == "cuda":
            torch.cuda.synchronize()
        rss_peak = max(memory_probe.hwm_bytes(), sampler.max) - rss_base
        heap_peak = (max(sampler.max_live, heap_peak_by_op) - heap_base) if heap_base is not None else None
        cuda_peak = torch.cuda.max_memory_allocated() - cuda_base if device == "cuda" else None
        reserved_peak = torch.cuda.max_memory_reserved() - reserved_base if device == "cuda" else None
        # This rank's tokens per optimizer step: TP ranks share theirs, CP ranks split theirs.
        tokens = (batch_size * seq_len * gradient_accumulation_steps / max(config.tp_size, 1) / config.cp_size
                  / config.sp_size)
        # Timed: the steps after the first (which allocates the optimizer states) and before the last (which runs
        # the tally's dispatch hooks), as far as there are any.
        timed = sorted(step_s[1:-1] or step_s[1:] or step_s)
        compute = timed[len(timed) // 2]
        prediction = predict_step(compute, last_step_calls, tokens_per_step_per_gpu=tokens,
                                  interconnect=interconnect)
    notes = ["losses not reported: under the fake group the gathered weights hold whatever the buffers held"]
    if config.is_auto_layout:
        c = layout.config
        notes.append(f"shard_size='auto' chose: {c.replicate_size} replicas x {c.shard_size} shards, reshard_after_"
                     f"forward={c.reshard_after_forward}, activation_checkpointing={c.activation_checkpointing}, "
                     f"cpu_offload={c.cpu_offload}"
                     + "".join(f", {name}={getattr(c, name)}" for name in ("loss_tile_size", "mlp_tile_size")
                               if getattr(c, name) is not None)  # the tiles the planner turned on, if any
                     + f" (budget {config.memory_budget} bytes)")
    if steps == 1:
        notes.append("one step: its compute time includes the first step's one-off work (optimizer states, kernels)")
    elif steps == 2:
        notes.append("two steps: the timed one also ran the collective tally's (and on CPU the heap probe's) "
                     "dispatch hooks; --steps 3 or more times steps without them")
    if layout.config.ep_size > 1:
        notes.append("expert parallelism: the token exchange assumed symmetric (balanced routing); "
                     "the tally's timing includes its dispatch hook")
    return RankReport(
        rank=rank, world_size=world_size, device=device, setup=estimate.setup(), steps=steps, step_s=step_s,
        compute_s=compute, cuda_allocated_peak=cuda_peak, cuda_reserved_peak=reserved_peak, rss_peak=rss_peak,
        heap_live_peak=heap_peak, estimate_device_bytes=estimate.device_bytes,
        estimate_heap_kept_bytes=estimate.heap_kept_bytes,
        collectives=summarize(last_step_calls), prediction=prediction.to_dict(), notes=notes)


class _HeapPeak(TorchDispatchMode):
    """glibc's live bytes read after every op of a step (CPU): the exact peak at op granularity, which a sampling
    thread can miss (a gradient alive for a few milliseconds)."""

    def __init__(self):
        super().__init__()
        self.max_live = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor's ops desugar into plain ones that come back here (collective_tally.py)
        out = func(*args, **(kwargs or {}))
        self.max_live = max(self.max_live, memory_probe.malloc_bytes()["live"])
        return out


def _train(model, config: FSDP2Config, device: str, batch_size: int, seq_len: int, steps: int,
           accumulation: int, measure_heap: bool = False, cp_mesh=None) -> tuple[list[float], list[Collective], int]:
    """`steps` AdamW steps of `accumulation` micro-batches on random tokens; each step's wall time (device
    synchronised) and the collectives the last one issued. Expert parallelism needs the tally's symmetric all-to-all
    in every step (the exchange is sized by it); otherwise the tally runs in the last step only, so the timed
    steps before it pay no dispatch hook. With `measure_heap` (CPU) the last step also reads glibc's live bytes
    after every op; that peak is the third value returned. With `cp_mesh` every micro-batch of `seq_len` tokens is
    split over its ranks by torch's `context_parallel`, as `accelerator.maybe_context_parallel` splits a launch's."""
    from ..sharding.engine import local_batch, no_sync

    vocab = model.config.vocab_size if hasattr(model, "config") else 32000
    generator = torch.Generator().manual_seed(dist.get_rank())
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    every_step = config.ep_size > 1
    times, heap_peak = [], 0
    for step in range(steps):
        tally = CollectiveTally(symmetric_all_to_all=True)
        use_tally = every_step or step == steps - 1
        heap = _HeapPeak() if measure_heap and step == steps - 1 else None
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with tally if use_tally else contextlib.nullcontext(), heap if heap is not None else contextlib.nullcontext():
            for micro in range(accumulation):
                ids = torch.randint(0, vocab, (batch_size, seq_len), generator=generator).to(device)
                sync = contextlib.nullcontext() if micro == accumulation - 1 else no_sync(model)
                batch = {"input_ids": ids, "labels": ids}
                if config.sp_size > 1:  # an all-ones mask, as a collator gives: without one Ulysses all-gathers the
                    # position ids to refuse packed rows, and under the fake group the gathered values are garbage
                    batch["attention_mask"] = torch.ones_like(ids)
                with sync:
                    if cp_mesh is not None:
                        _context_parallel_step(model, batch, cp_mesh)
                    else:  # this rank's slice of each sequence under sp_size > 1 (Ulysses), as a user's loop feeds it
                        model(**local_batch(batch, model)).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if device == "cuda":
                torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        heap_peak = max(heap_peak, heap.max_live if heap is not None else 0)
    return times, tally.calls, heap_peak


def _context_parallel_step(model, batch: dict, cp_mesh) -> None:
    """One forward and backward inside torch's `context_parallel` (the context `maybe_context_parallel` enters):
    ids, labels shifted before the split (a rank's last token's label is the next rank's first token) and position
    ids cut along the sequence, load balanced; the model computes its loss on its slice."""
    from torch.distributed.tensor.experimental import context_parallel

    ids = batch["input_ids"]
    shift = torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:].contiguous()
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids).clone()
    labels = ids.clone()
    buffers = [ids, labels, shift, positions]
    with context_parallel(cp_mesh, buffers=buffers, buffer_seq_dims=[1] * len(buffers), no_restore_buffers=set(buffers)):
        model(input_ids=ids, labels=labels, shift_labels=shift, position_ids=positions).loss.backward()


def simulate_ranks(ranks: Sequence[int], model: Any, world_size: int, config: FSDP2Config | None = None,
                   **kwargs: Any) -> list[RankReport]:
    """`simulate_rank` for each of `ranks`, one after the other, each in a process of its own (a fake group is per
    process, and one rank's heap must not inflate the next one's peak). The processes come from multiprocessing's
    fork server, a clean single-threaded interpreter that imports this module once: a plain fork of the caller
    would inherit its OpenMP and CUDA state (a child of a process that ran parallel CPU ops hangs in its first
    one; one of a process that initialised CUDA cannot use it)."""
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])  # a no-op once the server runs (e.g. started by a test harness)
    reports = []
    for rank in ranks:
        parent, child = context.Pipe(duplex=False)
        process = context.Process(target=_rank_child, args=(child, rank, model, world_size, config, kwargs))
        process.start()
        child.close()
        try:
            kind, payload = parent.recv()
        except EOFError:
            kind, payload = "died", None
        process.join()
        if kind == "ok":
            reports.append(payload)
        elif kind == "error":
            raise ValueError(f"rank {rank}: {payload}")
        else:
            raise RuntimeError(f"simulated rank {rank} died (exit code {process.exitcode}) before reporting; "
                               f"{payload or 'see its output above'}")
    return reports


def _rank_child(conn, rank: int, model: Any, world_size: int, config: FSDP2Config | None, kwargs: dict) -> None:
    import traceback

    try:
        conn.send(("ok", simulate_rank(model, world_size, config, rank=rank, **kwargs)))
    except ValueError as e:  # a refusal: one line, no traceback
        conn.send(("error", str(e)))
    except BaseException:  # noqa: BLE001 - anything else is reported with its traceback
        conn.send(("died", traceback.format_exc()))
    finally:
        conn.close()


def format_reports(reports: Sequence[RankReport]) -> str:
    """The reports as a table: measured per rank, then the prediction (labelled so)."""
    from ..planner.memory_report import format_bytes

    def size(n: int | None) -> str:
        return "-" if n is None else format_bytes(n)

    first = reports[0]
    lines = [f"one rank of {first.world_size}, simulated on {first.device} under torch's fake process group "
             f"(collectives move nothing); {first.setup}"]
    lines.append(f"{'rank':>5} {'CUDA alloc':>11} {'CUDA resv':>11} {'RSS':>11} {'heap live':>11} {'estimate':>11} "
                 f"{'ratio':>6} {'heap/est':>8} {'compute s':>10}")
    for r in reports:
        heap = "-" if r.heap_ratio is None else f"{r.heap_ratio:.2f}"
        lines.append(f"{r.rank:>5} {size(r.cuda_allocated_peak):>11} {size(r.cuda_reserved_peak):>11} "
                     f"{size(r.rss_peak):>11} {size(r.heap_live_peak):>11} {size(r.estimate_device_bytes):>11} "
                     f"{r.estimate_ratio:>6.2f} {heap:>8} {r.compute_s:>10.3f}")
    lines.append(f"ratio: measured {'CUDA allocated' if first.cuda_allocated_peak is not None else 'RSS'} peak over the "
                 "estimate's device peak (hf-fsdp2 estimate-memory, same setup); heap/est: glibc's live bytes over it "
                 "(CPU: RSS also counts the heap's free chunks, up to the estimate's heap bound "
                 f"{size(first.estimate_heap_kept_bytes)})")
    lines.append(f"collectives per optimizer step on rank {first.rank} (bytes on the wire by the ring algorithm):")
    for c in first.collectives:
        lines.append(f"  {c['kind']:<15} group of {c['group_size']:<4} {c['calls']:>6} calls  "
                     f"buffers {format_bytes(int(c['buffer_bytes'])):>10}  wire {format_bytes(int(c['wire_bytes'])):>10}")
    p = first.prediction
    lines.append(f"PREDICTED (a model, not a run; assumptions in hf_fsdp2/planner/step_time.py): step "
                 f"{p['step_s']:.3f} s = compute {p['compute_s']:.3f} s + exposed communication "
                 f"{p['exposed_comm_s']:.4f} s ({p['overlapped_comm_s']:.4f} s hidden behind compute); "
                 f"{p['tokens_per_s_per_gpu']:.0f} tokens/s per GPU")
    lines.append(f"  interconnect: {p['interconnect']['source']}")
    lines += [f"note: {n}" for n in first.notes]
    return "\n".join(lines)
