"""Where a backward pass spends its time: train_bench's contestants side by side under torch.profiler, one
backward each in the same ranks (the issue's "where we are slower, the profile"), self CPU time per op.

    python benchmarks/backward_profile.py                                # ours vs fsdp1, full, 2 ranks (~1 min)
    python benchmarks/backward_profile.py --mode lora --contestants ours fsdp1 accelerate

train_bench's `small` Llama and wrappers; two warm-up steps each, then one profiled backward (rank 0's
profile printed; both ranks' totals). Self times of waits land in different places (FSDP1 waits inside
its hooks, FSDP2 in its collectives), so compare the compute and copy ops, and the totals.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402


def _profile(rank: int, world: int, job: dict) -> dict:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    import train_bench as tb

    torch.set_num_threads(1)
    ids = torch.randint(0, tb.MODEL_SIZES["small"]["vocab_size"], (job["batch"] // world, job["seq"]),
                        generator=torch.Generator().manual_seed(rank))
    out = {}
    for name in job["contestants"]:
        ctx = {"rank": rank, "device": torch.device("cpu"), "mode": job["mode"], "seq": job["seq"],
               "micro_batch": job["batch"] // world, "fsdp1_full_policy": "transformer"}
        model = tb.WRAPPERS[name](tb.build_model("small", job["mode"], 0), ctx)
        opt = tb.make_optimizer(model, 1e-4, "fused")
        for _ in range(2):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        dist.barrier()
        loss = model(input_ids=ids, labels=ids).loss
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            loss.backward()
        events = prof.key_averages()
        rows = sorted(((e.key, e.self_cpu_time_total / 1e3, e.count) for e in events), key=lambda r: -r[1])
        out[name] = {"total_ms": sum(e.self_cpu_time_total for e in events) / 1e3, "top": rows[:job["top"]]}
        opt.zero_grad()
        del model, opt
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contestants", nargs="+", default=["ours", "fsdp1"])
    ap.add_argument("--mode", choices=("full", "lora"), default="full")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    job = {"contestants": args.contestants, "mode": args.mode, "batch": args.batch, "seq": args.seq, "top": args.top}
    ranks = harness.run_ranks(_profile, args.world_size, job, timeout=900)
    for name in args.contestants:
        totals = " / ".join(f"{r[name]['total_ms']:.0f}" for r in ranks)
        print(f"== {name} ({args.mode}, {args.world_size} ranks): one backward, self CPU total {totals} ms per rank")
        for key, ms, count in ranks[0][name]["top"]:
            print(f"   {ms:8.1f} ms  {count:5d}  {key}")


if __name__ == "__main__":
    main()
