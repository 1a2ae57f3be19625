"""Eager, regional compilation and compile="model" side by side on the tests' tiny Llama (2 ranks, gloo):
collectives per step as the backend received them, step times, the first step (compiling), bytes autograd
saved for backward, losses. The issue's "communication optimised by the compiler" at a size where
collectives dominate; train_bench.py's `ours_compile_model` contestant measures it at 57M.

    python benchmarks/compile_modes.py                 # every mode (~2 min)
    python benchmarks/compile_modes.py eager model     # some of them

Modes: eager (FSDP2, `shard_model`), regional (`compile=True`), model (`compile="model"`: buckets of one
decoder layer by default), model_one_bucket (`bucket_cap_mb=1000`: the whole model per bucket), model_keep
(that plus `reshard_after_forward=False`: no re-gather in backward), model_ac (`activation_checkpointing`).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

MODES = {
    "eager": {},
    "regional": {"compile": True},
    "model": {"compile": "model"},
    "model_one_bucket": {"compile": "model", "bucket_cap_mb": 1000},
    "model_keep": {"compile": "model", "bucket_cap_mb": 1000, "reshard_after_forward": False},
    "model_ac": {"compile": "model", "activation_checkpointing": True},
}


def _run(rank: int, world: int, mode: str, steps: int = 6) -> dict:
    """One rank: `steps` steps of the tiny Llama in `mode`; the last profiled."""
    import contextlib

    import torch
    import torch.distributed as dist

    import harness
    from hf_fsdp2 import FSDP2Config, shard_model
    from tests.common import batches, build_model, local_rows, optimizer

    model = shard_model(build_model(), FSDP2Config(**MODES[mode]))
    opt = optimizer(model)
    saved = [0]

    def pack(tensor):
        saved[0] += tensor.numel() * tensor.element_size()
        return tensor

    losses, times, profiled = [], [], {}
    for i, ids in enumerate(batches(steps)):
        ids = local_rows(ids, rank, world)
        saved[0] = 0
        start = time.perf_counter()
        with harness.backend_collectives(profiled) if i == steps - 1 else contextlib.nullcontext():
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
        times.append(time.perf_counter() - start)
        value = loss.detach().clone()
        dist.all_reduce(value)
        losses.append(value.item() / world)
    calls = {op.split(":", 1)[1]: n for op, n in profiled["backend_collectives"].items()}
    return {"losses": losses, "first_s": times[0], "step_ms": sorted(1000 * t for t in times[1:]),
            "calls": calls, "saved_kib": saved[0] / 1024}


def main(modes: list[str]) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.dist_harness import run_ranks

    print(f"{'mode':18s} {'all-gathers/reduce-scatters':>28s} {'step ms (median, min-max)':>27s} "
          f"{'first step':>10s} {'saved KiB':>9s}  losses")
    for mode in modes:
        r = run_ranks(_run, 2, mode, timeout=1800)[0]
        ms = r["step_ms"]
        # gloo runs a reduce-scatter as an all-reduce; the loss's all-reduce is outside the profiled step
        calls = f"{r['calls'].get('all_gather', 0)} / {r['calls'].get('all_reduce', 0)}"
        print(f"{mode:18s} {calls:>28s} {ms[len(ms) // 2]:>10.1f} ({ms[0]:.1f}-{ms[-1]:.1f}){'':>6s} "
              f"{r['first_s']:>9.1f}s {r['saved_kib']:>9.0f}  {[round(v, 5) for v in r['losses']]}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or list(MODES))
