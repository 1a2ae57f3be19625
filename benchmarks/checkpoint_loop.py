"""Checkpoints inside a training loop: how long training waits per save, side by side in one run.

`python benchmarks/checkpoint_bench.py --training-loop [options]` (or this file directly) spawns N
gloo ranks on CPU; each trains a sharded Llama (AdamW) for --steps steps, saving the training state
every --save-every steps, once per mode, the modes interleaved in one process so they share the
machine's state:

  none        no saves: the baseline step time.
  sync        `hf_fsdp2.save_state(...)`: durable (fsync) and committed when it returns.
  async       `hf_fsdp2.save_state(..., blocking=False)`: returns once each rank's rows are copied to
              host staging memory; write, fsync, agreement and commit run in the background.
  dcp_async   torch DCP `async_save` of the model + optimizer state dicts (get_*_state_dict), on its
              own gloo group as torchtitan does; the next save waits for the previous one.

Reported (max over ranks, after one warm-up loop per mode; the last save is --save-every steps
before the end, so every background write overlaps training):
  blocked_s     time the training thread spends in the save call, per save.
  overlap_step  mean step time while a background save is in flight, against `none`'s step time.
  overhead_s    (step times + blocked + the final wait - steps x `none`'s median step) / saves:
                what a save really costs the training loop.
  staging_mb    extra host memory that stays allocated for asynchronous saves (our staging pool =
                one copy of the rank's shard of model + optimizer state).
Targets (issue 16): async blocked <= 10% of sync and <= dcp_async's; async overhead <= 25% of sync.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODES = ("none", "sync", "async", "dcp_async")


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _build(shape: dict):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_fsdp2

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**shape, max_position_embeddings=512, tie_word_embeddings=False))
    hf_fsdp2.shard_model(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def run_job(rank: int, world: int, job: dict) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    import hf_fsdp2
    from hf_fsdp2.checkpoint import async_save

    root = Path(job["tmp"])
    model, opt = _build(job["shape"])
    gen = torch.Generator().manual_seed(rank)
    batch = torch.randint(0, job["shape"]["vocab_size"], (job["batch"], job["seq_len"]), generator=gen)
    dcp_group = dist.new_group(backend="gloo")

    def step():
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()

    def save(mode: str, path: Path):
        if mode == "sync":
            hf_fsdp2.save_state(path, model, opt, step=0)
            return None
        if mode == "async":
            return hf_fsdp2.save_state(path, model, opt, step=0, blocking=False)
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        return dcp.async_save(state, checkpoint_id=str(path), process_group=dcp_group)

    def loop(mode: str, warm: bool) -> dict:
        """`steps` steps; a save every `save_every` steps, the last one `save_every` steps before the end,
        so that its background write overlaps training like the others."""
        pending, blocked, overlap, steps = None, [], [], []
        dist.barrier()
        for i in range(1, job["steps"] + 1):
            in_flight = pending is not None and not pending.done()
            t = time.perf_counter()
            step()
            (overlap if in_flight else steps).append(time.perf_counter() - t)
            if mode != "none" and i % job["save_every"] == 0 and i <= job["steps"] - job["save_every"]:
                path = root / f"{mode}-{i}-{'warm' if warm else 'timed'}"
                t = time.perf_counter()
                if pending is not None and mode == "dcp_async":
                    pending.result()  # one save in flight, as ours (ours waits inside save_state)
                pending = save(mode, path)
                blocked.append(time.perf_counter() - t)
        t = time.perf_counter()
        if pending is not None:
            pending.result() if mode == "dcp_async" else pending.wait()
        final_wait = time.perf_counter() - t
        dist.barrier()
        return {"blocked_s": blocked, "overlap_steps_s": overlap, "steps_s": steps, "final_wait_s": final_wait}

    out = {"rss_before_mb": _rss_mb()}
    for mode in MODES:  # warm-up: allocations, the staging pool, DCP's planning caches
        loop(mode, warm=True)
    for mode in MODES:
        out[mode] = loop(mode, warm=False)
        if rank == 0:
            for p in root.iterdir():
                shutil.rmtree(p, ignore_errors=True)
        dist.barrier()
    out["staging_mb"] = async_save.staging_pool().nbytes() / 2**20
    out["shard_state_mb"] = (sum(p.to_local().numel() * p.element_size() for p in model.parameters())
                             + sum(t.to_local().numel() * t.element_size() for s in opt.state.values()
                                   for t in s.values() if torch.is_tensor(t) and t.dim() > 0)) / 2**20
    out["rss_after_mb"] = _rss_mb()
    return out


def summarize(ranks: list[dict]) -> dict:
    """Per mode, the worst rank: median blocked time per save, mean step time while a save is in
    flight, and the overhead per save = (all step times + blocked + the final wait - steps x the
    `none` median step) / saves: what the saves cost the loop, measured from step times so that the
    barriers' and the loop's other noise does not enter."""
    base_step = max(statistics.median(r["none"]["steps_s"]) for r in ranks)
    rows = {}
    for mode in MODES[1:]:
        per_rank = [r[mode] for r in ranks]
        saves = len(per_rank[0]["blocked_s"])
        rows[mode] = {
            "blocked_s": max(statistics.median(m["blocked_s"]) for m in per_rank),
            "overlap_step_s": max(statistics.mean(m["overlap_steps_s"]) if m["overlap_steps_s"] else 0.0
                                  for m in per_rank) or None,
            "overhead_s": max((sum(m["steps_s"]) + sum(m["overlap_steps_s"]) + sum(m["blocked_s"]) + m["final_wait_s"]
                               - base_step * (len(m["steps_s"]) + len(m["overlap_steps_s"]))) / saves
                              for m in per_rank),
        }
    return {"step_s": base_step, "modes": rows, "staging_mb": max(r["staging_mb"] for r in ranks),
            "shard_state_mb": max(r["shard_state_mb"] for r in ranks)}


def main(argv=None) -> int:
    from harness import RESULTS_DIR, TMP_ROOT
    from harness import run_ranks as spawn

    def run_ranks(world: int, job: dict, timeout: float) -> list[dict]:  # the spawner the other benchmarks use
        return spawn(run_job, world, job, timeout)

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--save-every", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=3600.0)
    args = ap.parse_args(argv)
    shape = {"hidden_size": args.hidden, "intermediate_size": int(args.hidden * 8 / 3) // 64 * 64,
             "num_hidden_layers": args.layers, "num_attention_heads": max(1, args.hidden // 64),
             "num_key_value_heads": max(1, args.hidden // 64), "vocab_size": args.vocab}
    tmp = TMP_ROOT / f"loop-{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        ranks = run_ranks(args.world_size, {"run": "loop", "tmp": str(tmp), "shape": shape, "batch": args.batch,
                                            "seq_len": args.seq_len, "steps": args.steps,
                                            "save_every": args.save_every}, args.timeout)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    s = summarize(ranks)
    sync, ours, peer = s["modes"]["sync"], s["modes"]["async"], s["modes"]["dcp_async"]
    print(f"{args.world_size} ranks, shard of model + AdamW state per rank {s['shard_state_mb']:.0f} MiB, "
          f"step {s['step_s']:.3f} s, a save every {args.save_every} steps")
    print(f"{'mode':<10} {'blocked/save':>13} {'step in overlap':>16} {'overhead/save':>14}")
    for mode, row in s["modes"].items():
        overlap = f"{row['overlap_step_s']:.3f} s" if row["overlap_step_s"] else "-"
        print(f"{mode:<10} {row['blocked_s']:>11.3f} s {overlap:>16} {row['overhead_s']:>12.3f} s")
    ratios = {"async_blocked_vs_sync": ours["blocked_s"] / sync["blocked_s"],
              "async_blocked_vs_dcp_async": ours["blocked_s"] / peer["blocked_s"],
              "async_overhead_vs_sync": ours["overhead_s"] / sync["blocked_s"]}
    print(f"async blocked / sync save: {ratios['async_blocked_vs_sync']:.3f} (target <= 0.10); "
          f"/ dcp_async blocked: {ratios['async_blocked_vs_dcp_async']:.2f} (target <= 1); "
          f"async overhead / sync save: {ratios['async_overhead_vs_sync']:.3f} (target <= 0.25)")
    print(f"staging memory: {s['staging_mb']:.0f} MiB per rank (one copy of the rank's shard)")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    out = RESULTS_DIR / f"checkpoint_loop_{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"argv": sys.argv[1:], "shape": shape, "summary": s, "ratios": ratios,
                               "ranks": ranks}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
