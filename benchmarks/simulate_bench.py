"""One rank of a large job, simulated on this CPU (issue 61, item 4): `hf-fsdp2 simulate`'s route (torch's fake
process group, the model from its config, shard_model, AdamW steps) at real shapes, ranks 0 and N-1, per-rank
RSS and glibc live bytes against `estimate-memory`'s peak for the same setup.

    python benchmarks/simulate_bench.py                      # both cases (tens of minutes on 2 cores)
    python benchmarks/simulate_bench.py --cases llama32_1b_8  # one of them

Cases (random weights, fp32 storage and compute, AdamW, batch 1):
  llama32_1b_8   Llama-3.2-1B's shape (1.24B, tied embeddings) on 8 ranks, seq 512, 2 steps.
  llama31_8b_64  Llama-3.1-8B's shape (8.03B) on 64 ranks, seq 256, 1 step.
  llama31_70b_qlora_8  Llama-3.1-70B's widths, 4 of its 80 layers (CPU time), QLoRA: NF4 base from bf16, LoRA r 16
                 on every projection, bf16 compute, on 8 ranks, seq 128, 2 steps (needs bitsandbytes).
  llama31_8b_auto_8  shard_size="auto" with a 10 GiB budget per rank: Llama-3.1-8B's widths, 4 of its 32 layers,
                 bf16 compute over fp32 master weights, 8 ranks, seq 1024, 2 steps; the layout the planner picks and
                 the measured peak against the budget (issue 61: auto fits its budget at the 8B shape).
  llama31_70b_qlora_auto_8  the same at Llama-3.1-70B's widths, 4 layers, QLoRA as above, budget 7 GiB, seq 512.
Results: stdout and benchmarks/results/simulate-*.json.
"""

from __future__ import annotations

import argparse

import harness

CASES = {
    "llama32_1b_8": dict(world=8, seq=512, steps=2, shape=dict(
        model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True, max_position_embeddings=4096)),
    "llama31_8b_64": dict(world=64, seq=256, steps=1, shape=dict(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False, max_position_embeddings=8192,
        rope_theta=500000.0)),
    "llama31_70b_qlora_8": dict(world=8, seq=128, steps=2, dtype="bfloat16", config=dict(param_dtype="bfloat16"),
                               setup=dict(lora_r=16, lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                   "up_proj", "down_proj"), load_in_4bit=True),
                               shape=dict(model_type="llama", vocab_size=128256, hidden_size=8192,
                                          intermediate_size=28672, num_hidden_layers=4, num_attention_heads=64,
                                          num_key_value_heads=8, tie_word_embeddings=False,
                                          max_position_embeddings=8192, rope_theta=500000.0)),
    "llama31_8b_auto_8": dict(world=8, seq=1024, steps=2, config=dict(
        param_dtype="bfloat16", shard_size="auto", memory_budget="10GiB", plan_seq_len=1024, plan_batch_size=1),
        shape=dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                   num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False,
                   max_position_embeddings=8192, rope_theta=500000.0)),
    "llama31_70b_qlora_auto_8": dict(world=8, seq=512, steps=2, dtype="bfloat16", config=dict(
        param_dtype="bfloat16", shard_size="auto", memory_budget="7GiB", plan_seq_len=512, plan_batch_size=1),
        setup=dict(lora_r=16, lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                            "down_proj"), load_in_4bit=True),
        shape=dict(model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                   num_hidden_layers=4, num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False,
                   max_position_embeddings=8192, rope_theta=500000.0)),
}


def _budget_check(case: dict, reports) -> dict | None:
    """For an auto layout: each rank's measured peaks (glibc's live heap, RSS) against the budget it was given."""
    budget = case.get("config", {}).get("memory_budget")
    if budget is None:
        return None
    from hf_fsdp2.config import parse_bytes

    limit = parse_bytes(budget, "memory_budget")
    rows = {r.rank: {"heap_over_budget": r.heap_live_peak / limit if r.heap_live_peak is not None else None,
                     "rss_over_budget": r.rss_peak / limit} for r in reports}
    return {"budget_bytes": limit, "ranks": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {list(CASES)}")
    args = p.parse_args()
    from transformers import AutoConfig

    from hf_fsdp2 import FSDP2Config
    from hf_fsdp2.tools.simulate import format_reports, simulate_ranks

    results = {}
    for name in [c.strip() for c in args.cases.split(",") if c.strip()]:
        case = CASES[name]
        shape = dict(case["shape"])
        config = AutoConfig.for_model(shape.pop("model_type"), **shape)
        reports = simulate_ranks([0, case["world"] - 1], config, case["world"], FSDP2Config(**case.get("config", {})),
                                 batch_size=1, seq_len=case["seq"], steps=case["steps"], dtype=case.get("dtype"),
                                 **case.get("setup", {}))
        print(f"== {name}\n{format_reports(reports)}", flush=True)
        results[name] = {"world": case["world"], "seq_len": case["seq"], "steps": case["steps"],
                         "ranks": [r.to_dict() for r in reports]}
        check = _budget_check(case, reports)
        if check is not None:
            results[name]["budget"] = check
            print("measured over the budget given to shard_size='auto': " + "; ".join(
                f"rank {rank}: heap {row['heap_over_budget']:.2f}x, RSS {row['rss_over_budget']:.2f}x"
                for rank, row in check["ranks"].items()), flush=True)
    path = harness.write_results("simulate", None, cases=results)
    print(f"results: {path}")


if __name__ == "__main__":
    main()
