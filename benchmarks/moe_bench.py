"""Expert parallelism against FSDP2 alone on a mixture-of-experts model whose experts dominate its bytes (issue 49).

    python benchmarks/moe_bench.py            # 4 gloo ranks, Qwen3-MoE-shaped, fp32 + AdamW
    python benchmarks/moe_bench.py --tiny     # the same contestants in seconds (the suite runs it)

Contestants, side by side in one run, each loading the same hub-format checkpoint:
  fsdp2            hf_fsdp2.from_pretrained, FSDP2Config()            every expert all-gathered by every rank
  ep2, ep4         hf_fsdp2.from_pretrained, FSDP2Config(ep_size=E)   E/ep experts per rank, tokens by hf_fsdp2's
                   dispatch (sharding/expert_parallel/dispatch.py: fixed-size gathers and reduce-scatters, no host read per
                   layer)
  ep2_all_to_all,  the same with transformers' AllToAllEP as the dispatch (expert_parallel.dispatch.set_dispatch): what
  ep4_all_to_all   hf_fsdp2 ran before issue 64 (split sizes read to the host each layer, no padding)
  transformers,    from_pretrained(distributed_config=DistributedConfig(fsdp_size=4, ep_size=2 or 4)), adopted by
  transformers_ep4 hf_fsdp2.shard_model: transformers' own EP x FSDP2

Per contestant: FSDP2's all-gathered bytes and the EP token dispatch's bytes of one training step (torch.profiler's
c10d events, `_collective_bytes`), host reads per MoE layer in the next step's forwards (tests/host_reads.py:
item/tolist/bool/nonzero/... of a tensor; the even dispatch's one read of its CPU token-count tensor counted apart,
`host_int_reads_per_layer`), tokens/s over the timed steps (the median of `--repeat` round-robin runs), each
rank's own CPU seconds per timed step (max over ranks: what other load on the machine moves least), peak RSS per
rank over the steps (max over ranks), and the losses (equal across contestants: EP changes where experts run,
not the math).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import time
from pathlib import Path

import harness

SHAPE = dict(vocab_size=4096, hidden_size=512, intermediate_size=1024, moe_intermediate_size=512, num_experts=16,
             num_experts_per_tok=2, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
             max_position_embeddings=512, tie_word_embeddings=False)
TINY = dict(SHAPE, vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
            num_hidden_layers=2, num_attention_heads=4)
CONTESTANTS = ("fsdp2", "ep2", "ep4", "ep2_all_to_all", "ep4_all_to_all", "transformers", "transformers_ep4")


def _config(tiny: bool):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**(TINY if tiny else SHAPE))


def _collective_bytes(prof, ep: int) -> dict[str, int]:
    """Bytes of the step's collectives (values x 4 bytes, fp32): FSDP2's all-gathers' output buffers, and the EP token
    dispatch's ep x tokens buffers: the all-to-alls' outputs (AllToAllEP's, transformers' EP), hf_fsdp2's all-gathers
    (torch's functional ones: outputs ep x their input) and reduce-scatters (inputs), forward and backward."""
    out = {"all_gather": 0, "all_to_all": 0, "dispatch": 0}
    for event in prof.events():
        shape = event.input_shapes[0] if event.input_shapes and event.input_shapes[0] else None
        if shape is None:
            continue
        values = math.prod(shape)
        if event.name == "c10d::_allgather_base_":
            out["all_gather"] += 4 * values
        elif event.name == "c10d::alltoall_base_":
            out["all_to_all"] += 4 * values
            out["dispatch"] += 4 * values
        elif event.name == "_c10d_functional::all_gather_into_tensor":
            out["dispatch"] += 4 * values * ep
        elif event.name == "_c10d_functional::reduce_scatter_tensor":
            out["dispatch"] += 4 * values
    return out


def run_rank(rank: int, world: int, job: dict) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM

    import hf_fsdp2

    import sys

    sys.path.insert(0, str(harness.REPO))
    from hf_fsdp2.sharding.expert_parallel import dispatch as expert_dispatch
    from tests.host_reads import HostReads

    name = job["contestant"]
    if name.startswith("transformers"):
        from transformers.distributed import DistributedConfig

        model = AutoModelForCausalLM.from_pretrained(job["src"], distributed_config=DistributedConfig(
            fsdp_size=world, ep_size=4 if name.endswith("ep4") else 2))
        hf_fsdp2.shard_model(model)  # adopted as transformers sharded it
    else:
        ep = int(name[2]) if name.startswith("ep") else 1
        expert_dispatch.set_dispatch("all_to_all" if name.endswith("all_to_all") else "even")
        model = hf_fsdp2.from_pretrained(AutoModelForCausalLM, job["src"], hf_fsdp2.FSDP2Config(ep_size=ep),
                                         progress=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1 + rank)
    vocab = model.config.vocab_size
    data = [torch.randint(0, vocab, (job["batch"], job["seq"]), generator=g) for _ in range(job["warmup"] + 2 + job["steps"])]

    def step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    losses = [step(ids) for ids in data[:job["warmup"]]]
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        losses.append(step(data[job["warmup"]]))
    collective = _collective_bytes(prof, job["ep"])
    moe_blocks = [layer.mlp for layer in model.model.layers]
    reads = HostReads(expert_dispatch.host_buffers())  # a step of its own: the modes would show in the profile
    with reads.counting(), reads.windows(moe_blocks):
        losses.append(step(data[job["warmup"] + 1]))
    collective["host_reads"] = dict(reads.counts)
    collective["host_reads_per_layer"] = reads.total / len(moe_blocks)
    collective["host_int_reads_per_layer"] = reads.exempt_reads / len(moe_blocks)
    import torch.distributed as dist

    harness.malloc_trim()
    dist.barrier()
    harness.reset_hwm()
    start, cpu_start = time.perf_counter(), time.process_time()
    timed = data[job["warmup"] + 2:]
    losses += [step(ids) for ids in timed]
    cpu_seconds = time.process_time() - cpu_start  # this rank's own CPU: less moved by other load than the wall
    dist.barrier()
    seconds = time.perf_counter() - start
    return {"losses": losses, "seconds": seconds, "cpu_s_per_step": cpu_seconds / len(timed),
            "peak_rss": harness.hwm_bytes(), **collective, "tokens": len(timed) * job["batch"] * job["seq"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--contestants", nargs="+", choices=CONTESTANTS, default=list(CONTESTANTS))
    p.add_argument("--steps", type=int, default=4, help="timed steps, after a warm-up, a profiled and a counted step")
    p.add_argument("--repeat", type=int, default=1,
                   help="run the contestants this many times, round-robin (a loaded machine): tokens/s is the median")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    args = p.parse_args(argv)
    world = 4
    root = harness.TMP_ROOT / f"moe_bench-{os.getpid()}"  # its own: a --tiny run (the suite) may run beside it
    shutil.rmtree(root, ignore_errors=True)
    import torch
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(_config(args.tiny))
    expert_bytes = sum(p.numel() * 4 for n, p in model.named_parameters() if ".experts." in n)
    total_bytes = sum(p.numel() * 4 for p in model.parameters())
    model.save_pretrained(root / "src")
    del model
    seq = 16 if args.tiny else args.seq
    steps = 1 if args.tiny else args.steps
    results = {}
    for _ in range(args.repeat):
        for name in args.contestants:
            ep = int(name[2]) if name.startswith("ep") else 4 if name.endswith("ep4") else 2 if name == "transformers" else 1
            job = {"contestant": name, "src": str(root / "src"), "batch": args.batch, "seq": seq, "warmup": 1,
                   "steps": steps, "ep": ep}
            ranks = harness.run_ranks(run_rank, world, job, timeout=3600, threads=1,
                                      preload=harness.TINY_PRELOAD if args.tiny else ())
            speed = world * ranks[0]["tokens"] / max(r["seconds"] for r in ranks)
            cpu = max(r["cpu_s_per_step"] for r in ranks)
            if name in results:
                results[name]["tokens_per_s_runs"].append(speed)
                results[name]["cpu_s_per_step_runs"].append(cpu)
                continue
            results[name] = {
                "losses": ranks[0]["losses"], "rank_losses": [r["losses"] for r in ranks],
                "all_gather_bytes": max(r["all_gather"] for r in ranks),
                "all_to_all_bytes": max(r["all_to_all"] for r in ranks),
                "dispatch_bytes": max(r["dispatch"] for r in ranks), "peak_rss": max(r["peak_rss"] for r in ranks),
                "tokens_per_s_runs": [speed], "cpu_s_per_step_runs": [cpu],
                "host_reads_per_layer": max(r["host_reads_per_layer"] for r in ranks),
                "host_reads": ranks[0]["host_reads"],
                "host_int_reads_per_layer": max(r["host_int_reads_per_layer"] for r in ranks),
            }
    for r in results.values():
        r["tokens_per_s"] = statistics.median(r["tokens_per_s_runs"])
        r["cpu_s_per_step"] = statistics.median(r["cpu_s_per_step_runs"])
    shutil.rmtree(root, ignore_errors=True)
    base = results.get("fsdp2")
    lines = [f"Qwen3-MoE shape {'(tiny)' if args.tiny else ''} {total_bytes / 2**20:.0f} MiB fp32, experts "
             f"{expert_bytes / total_bytes:.0%} of it; {world} ranks, batch {args.batch} x seq {seq} per rank",
             f"{'contestant':16s} {'all-gather/step':>16s} {'dispatch/step':>16s} {'peak RSS':>10s} {'tokens/s':>9s}"
             f"         CPU s/step  host reads/MoE layer  loss diff"]
    for name, r in results.items():
        rel = (f" ({r['all_gather_bytes'] / base['all_gather_bytes']:.2f}x)" if base else "")
        speed = (f" ({r['tokens_per_s'] / base['tokens_per_s']:.2f}x)" if base else "")
        diff = max(abs(a - b) for a, b in zip(r["losses"], base["losses"])) if base else float("nan")
        lines.append(f"{name:16s} {r['all_gather_bytes'] / 2**20:9.1f} MiB{rel:>8s} {r['dispatch_bytes'] / 2**20:8.1f} MiB "
                     f"{r['peak_rss'] / 2**30:7.2f} GiB {r['tokens_per_s']:8.0f}{speed:8s} {r['cpu_s_per_step']:6.2f}     "
                     f"{r['host_reads_per_layer']:4.1f} (+{r['host_int_reads_per_layer']:.0f} CPU int)  {diff:.1e}")
    print("\n".join(lines))
    path = harness.write_results("moe_bench", argv, world_size=world, tiny=args.tiny, shape=TINY if args.tiny else SHAPE,
                                 expert_fraction=expert_bytes / total_bytes, results=results)
    print(f"results: {path.relative_to(harness.REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
