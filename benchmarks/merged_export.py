"""Merged-LoRA export vs the disk: `save_pretrained(peft_model, dir, merge_adapters=True)` on N gloo ranks
against the same ranks writing the same bytes of random data with fsync, interleaved, side by side.

    python benchmarks/merged_export.py                       # Llama-3.2-1B's shape, bf16 base, LoRA r16, 2 ranks
    python benchmarks/merged_export.py --shape small --repeats 1

Each round: the disk baseline (as benchmarks/checkpoint_bench.py's raw_disk: rank 0 alone writes the merged
files' bytes in 16 MiB os.write blocks, then fsync), the merged save (durable, as by default), the same
with durable=False, then the adapter save; wall time between barriers. The target (issue 51): merged within
1.5x of the disk's time for the same bytes. Found here (2 ranks, 2 cores): every rank writes its rows into the
same file, and two processes' buffered writes into one file run at about half the speed of two files, whatever
the bytes (benchmarks/README.md); the merge's arithmetic is overlapped with the writes (weights_io.py).
Results: stdout and benchmarks/results/merged-*.json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from pathlib import Path

import harness

SHAPES = {  # Llama 3.2 1B (1.24B parameters, tied embeddings), and a small one for a quick look
    "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True),
    "small": dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=False),
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TARGET_RATIO = 1.5


def run_rank(rank: int, world: int, job: dict) -> dict:
    import torch
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_fsdp2

    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**SHAPES[job["shape"]], max_position_embeddings=2048))
    model = model.to(torch.bfloat16)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS, init_lora_weights=False))
    model = hf_fsdp2.shard_model(model, hf_fsdp2.FSDP2Config(replication="fsdp2"))  # materialised per rank
    with torch.device("meta"):  # the same base without adapters: a plain full-model save of the same bytes
        plain = LlamaForCausalLM(LlamaConfig(**SHAPES[job["shape"]], max_position_embeddings=2048)).to(torch.bfloat16)
    plain = hf_fsdp2.shard_model(plain, hf_fsdp2.FSDP2Config(replication="fsdp2"))
    root = Path(job["dir"])
    times: dict[str, list[float]] = {"disk": [], "merged": [], "full_model": [], "merged_not_durable": [],
                                     "adapter": []}
    merged_bytes = 0
    for _ in range(job["repeats"]):
        for what in times:
            out = root / what
            if rank == 0:
                shutil.rmtree(out, ignore_errors=True)
            os.sync()
            dist.barrier()
            t = time.perf_counter()
            if what == "disk":
                out.mkdir(parents=True, exist_ok=True)
                if rank == 0:
                    harness.write_fsync(out / "raw.bin", job["disk_bytes"])
            elif what == "full_model":
                hf_fsdp2.save_pretrained(plain, out, progress=False)
            else:
                hf_fsdp2.save_pretrained(model, out, merge_adapters=what.startswith("merged"), progress=False,
                                         durable=what != "merged_not_durable")
            dist.barrier()
            times[what].append(time.perf_counter() - t)
            if what == "merged":
                merged_bytes = sum(f.stat().st_size for f in out.iterdir())
                job["disk_bytes"] = merged_bytes  # the next round's baseline writes the same bytes
    return {"times": times, "merged_bytes": merged_bytes}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="rounds; the first round's disk baseline is skipped")
    args = p.parse_args(argv)
    work = harness.TMP_ROOT / "merged_export"
    work.mkdir(parents=True, exist_ok=True)
    # One warm-up round sizes the disk baseline (its disk write is 0 bytes), then the timed rounds.
    job = {"shape": args.shape, "dir": str(work), "repeats": args.repeats + 1, "disk_bytes": 0}
    ranks = harness.run_ranks(run_rank, args.world_size, job, timeout=3600, threads=1)
    times = {k: v[1:] for k, v in ranks[0]["times"].items()}
    gb = ranks[0]["merged_bytes"] / 1e9
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["merged"] / med["disk"]
    lines = [f"merged export, {args.shape} shape, {args.world_size} ranks, {gb:.2f} GB, {args.repeats} rounds (median):",
             f"  disk write+fsync  {med['disk']:.2f} s ({gb / med['disk']:.2f} GB/s)",
             f"  merged save       {med['merged']:.2f} s ({gb / med['merged']:.2f} GB/s) = {ratio:.2f}x the disk "
             f"({'met' if ratio <= TARGET_RATIO else 'MISSED'}: <= {TARGET_RATIO}x)",
             f"  full model save   {med['full_model']:.2f} s (the same bytes, no adapter: merged = "
             f"{med['merged'] / med['full_model']:.2f}x)",
             f"  merged, durable=False {med['merged_not_durable']:.2f} s",
             f"  adapter save      {med['adapter']:.2f} s"]
    print("\n".join(lines))
    path = harness.write_results("merged", argv, shape=args.shape, world_size=args.world_size, merged_bytes=gb * 1e9,
                                 times=times, median_s=med, merged_over_disk=ratio,
                                 merged_over_full_model=med["merged"] / med["full_model"], target=TARGET_RATIO)
    print(f"results: {path.relative_to(harness.REPO)}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
