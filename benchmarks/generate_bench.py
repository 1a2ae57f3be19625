"""generate() on a sharded model: group all-gathers per call and tokens/s, side by side in one run.

    python benchmarks/generate_bench.py [--world-size 2] [--new-tokens 16 64] [--layers 8] [--hidden 512]

Four ways, same random Llama, greedy decoding of a fixed batch:
  one process  the unsharded model on one process, the other cores idle (the reference output)
  replica      the unsharded model on every rank at once (DDP-style inference): the baseline that
               shares the cores and memory bandwidth as the sharded ranks do
  per token    hf_fsdp2-sharded, groups re-gathered for every token (FSDP2's own behaviour:
               sharding/generation.py with no memory for kept groups)
  once         hf_fsdp2-sharded, each group gathered once per generate() call (the default)
Prints all-gathers per generate(), tokens/s per rank (the slowest rank's time), the ratios to one
process and to the replicas, and whether the output equals one process's; writes benchmarks/results/generate-<stamp>.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402


def build(args):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                         num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=1024, tie_word_embeddings=False)
    return LlamaForCausalLM(config).eval()


def prompt(args):
    import torch

    return torch.randint(3, 1000, (args.batch, args.prompt_len), generator=torch.Generator().manual_seed(1))


def generate(model, ids, tokens: int):
    import torch

    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                              min_new_tokens=tokens, do_sample=False)


def run_job(rank: int, world: int, job: dict) -> dict:
    import torch
    import torch.distributed as dist

    import hf_fsdp2
    from hf_fsdp2.sharding import generation

    torch.set_num_threads(job["threads"])
    args = argparse.Namespace(**job["args"])
    ids = prompt(args)
    out = {}
    # The unsharded model on every rank at once (replicas, as DDP would run it): the baseline that shares
    # the machine (cores, memory bandwidth) the way the sharded ranks do.
    replica = build(args)
    for tokens in args.new_tokens:
        generate(replica, ids, 2)
        dist.barrier()
        start = time.perf_counter()
        result = generate(replica, ids, tokens)
        out[f"replica/{tokens}"] = {"seconds": time.perf_counter() - start, "all_gathers": 0,
                                    "output": result.tolist()}
    del replica
    model = build(args)
    hf_fsdp2.shard_model(model, hf_fsdp2.FSDP2Config())
    calls = {"n": 0}
    original = dist.all_gather_single  # what FSDP2 calls (_fsdp_collectives.DefaultAllGather)

    def counted(*a, **k):
        calls["n"] += 1
        return original(*a, **k)

    for mode, fraction in (("per token", 0.0), ("once", generation.FREE_MEMORY_FRACTION)):
        generation.FREE_MEMORY_FRACTION = fraction
        for tokens in args.new_tokens:
            generate(model, ids, 2)  # warm-up
            dist.barrier()
            calls["n"] = 0
            dist.all_gather_single = counted
            start = time.perf_counter()
            result = generate(model, ids, tokens)
            seconds = time.perf_counter() - start
            dist.all_gather_single = original
            out[f"{mode}/{tokens}"] = {"seconds": seconds, "all_gathers": calls["n"], "output": result.tolist()}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=16)
    args = ap.parse_args(argv)
    import torch

    threads = max(1, torch.get_num_threads() // args.world_size)
    torch.set_num_threads(threads)
    model, ids = build(args), prompt(args)
    reference = {}
    for tokens in args.new_tokens:
        generate(model, ids, 2)
        start = time.perf_counter()
        result = generate(model, ids, tokens)
        reference[tokens] = {"seconds": time.perf_counter() - start, "output": result.tolist()}
    ranks = harness.run_ranks(run_job, args.world_size, {"args": vars(args), "threads": threads}, timeout=1800)
    rank0 = ranks[0]
    rows = []
    print(f"{args.layers} layers, hidden {args.hidden}, batch {args.batch}, {args.world_size} ranks, "
          f"{threads} threads per process")
    print(f"{'new tokens':>10}  {'mode':>11}  {'all-gathers':>11}  {'tokens/s':>9}  {'x one process':>13}  "
          f"{'x replicas':>10}  equal")
    for tokens in args.new_tokens:
        ref = reference[tokens]
        ref_tps = args.batch * tokens / ref["seconds"]
        replica_tps = args.batch * tokens / max(r[f"replica/{tokens}"]["seconds"] for r in ranks)
        print(f"{tokens:>10}  {'one process':>11}  {0:>11}  {ref_tps:>9.1f}  {1.0:>13.2f}  {'-':>10}  -")
        for mode in ("replica", "per token", "once"):
            # the slowest rank's time: the call ends for every rank when the slowest is done
            seconds = max(r[f"{mode}/{tokens}"]["seconds"] for r in ranks)
            r = rank0[f"{mode}/{tokens}"]
            tps = args.batch * tokens / seconds
            equal = r["output"] == ref["output"]
            print(f"{tokens:>10}  {mode:>11}  {r['all_gathers']:>11}  {tps:>9.1f}  {tps / ref_tps:>13.2f}  "
                  f"{tps / replica_tps:>10.2f}  {equal}")
            rows.append({"new_tokens": tokens, "mode": mode, "all_gathers": r["all_gathers"], "tokens_per_s": tps,
                         "ratio_to_one_process": tps / ref_tps, "ratio_to_replicas": tps / replica_tps,
                         "equal_output": equal})
    path = harness.write_results("generate", argv, rows=rows)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
