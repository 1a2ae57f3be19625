"""FSDP alone vs tensor parallelism x FSDP vs context parallelism x FSDP: tokens/s and peak memory per
rank, side by side in one run.

    python benchmarks/nd_bench.py [--world-size 4] [--seq-lens 64 512] [--layers 4] [--hidden 512]

Same random Llama, same global batch of sequences, AdamW; each layout runs in its own ranks:
  fsdp     dp_shard = world (hf_fsdp2's default)
  fsdp+tp  dp_shard = world / 2 x tp 2 (FSDP2Config(tp_size=2): the model's TP plan, then FSDP2)
  fsdp+cp  dp_shard = world / 2 x cp 2 (a ("dp_shard", "cp") mesh: FSDP2 over both, every sequence
           split over the cp pair by torch's context_parallel, ring attention; labels shifted before
           the split, the loss scaled so that the pair's mean is the batch's)
Prints the median step time's tokens/s per rank, the peak resident memory each rank added after the
model was built (training), their ratios to FSDP alone, the first loss (equal across layouts) and
the time of a gather-free `save_pretrained` of the trained model in each layout;
writes benchmarks/results/nd-<stamp>.json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402


def run_job(rank: int, world: int, job: dict) -> dict:
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_fsdp2

    torch.set_num_threads(job["threads"])
    args = argparse.Namespace(**job["args"])
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                         num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=max(args.seq_lens), tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    tp, cp = job["tp"], job["cp"]
    if cp > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel

        mesh = init_device_mesh("cpu", (world // cp, cp), mesh_dim_names=("dp_shard", "cp"))
        hf_fsdp2.shard_model(model, hf_fsdp2.FSDP2Config(), mesh=mesh)
    else:
        hf_fsdp2.shard_model(model, hf_fsdp2.FSDP2Config(tp_size=tp))
    harness.malloc_trim()
    base = harness.rss_bytes()
    harness.reset_hwm()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    split = tp * cp  # the "tp" / "cp" dimension is last: neighbouring ranks share a batch
    dp_rank, dp_world = rank // split, world // split
    out = {}
    for seq in args.seq_lens:
        g = torch.Generator().manual_seed(seq)
        times, first = [], None
        for step in range(args.steps):
            ids = torch.randint(0, 1024, (args.global_batch, seq), generator=g)
            per = args.global_batch // dp_world
            ids = ids[dp_rank * per:(dp_rank + 1) * per]
            dist.barrier()
            start = time.perf_counter()
            if cp > 1:
                ids, labels = ids.clone(), ids.clone()
                shift = torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:].contiguous()
                positions = torch.arange(seq).expand_as(ids).clone()
                items = (shift != -100).sum() / cp  # the cp pair's mean loss is the batch's
                buffers = [ids, labels, shift, positions]
                with context_parallel(mesh["cp"], buffers=buffers, buffer_seq_dims=[1] * 4,
                                      no_restore_buffers=set(buffers)):
                    loss = model(input_ids=ids, labels=labels, shift_labels=shift, position_ids=positions,
                                 num_items_in_batch=items).loss
                    loss.backward()
            else:
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - start)
            if first is None:
                value = loss.detach().clone()
                dist.all_reduce(value)
                first = value.item() / world
        step_s = statistics.median(times[1:])
        out[seq] = {"step_s": step_s, "tokens_per_s_per_rank": args.global_batch * seq / step_s / world,
                    "first_loss": first}
    out["peak_added_bytes"] = harness.hwm_bytes() - base
    # The gather-free save of this layout: a colwise TP block is whole rows of the file, a rowwise one
    # a column block written one row segment at a time (FileWriter.write_block); median of 3.
    seconds = []
    for i in range(3):  # into a directory all ranks share (made by main)
        dist.barrier()
        start = time.perf_counter()
        hf_fsdp2.save_pretrained(model, f"{job['save_dir']}/{i}", progress=False)
        seconds.append(time.perf_counter() - start)
    out["save_s"] = statistics.median(seconds)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[64, 512])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--global-batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args(argv)
    threads = max(1, (os.cpu_count() or 1) // args.world_size)
    results = {}
    import tempfile

    for name, tp, cp in (("fsdp", 1, 1), ("fsdp+tp", 2, 1), ("fsdp+cp", 1, 2)):
        save_dir = tempfile.mkdtemp(prefix="nd_bench-")
        ranks = harness.run_ranks(run_job, args.world_size, {"args": vars(args), "threads": threads, "tp": tp,
                                                             "cp": cp, "save_dir": save_dir},
                                  timeout=3600, threads=threads)
        shutil.rmtree(save_dir, ignore_errors=True)
        results[name] = {"seq": {seq: ranks[0][seq] for seq in args.seq_lens},
                         "peak_added_bytes": max(r["peak_added_bytes"] for r in ranks),
                         "save_s": max(r["save_s"] for r in ranks)}
    print(f"{args.layers} layers, hidden {args.hidden}, global batch {args.global_batch}, {args.world_size} ranks, "
          f"{threads} threads per rank ({os.cpu_count()} cores)")
    print(f"{'seq':>5}  {'layout':>8}  {'tokens/s/rank':>13}  {'x fsdp':>7}  {'first loss':>10}")
    rows = []
    for seq in args.seq_lens:
        ref = results["fsdp"]["seq"][seq]["tokens_per_s_per_rank"]
        for name in results:
            r = results[name]["seq"][seq]
            print(f"{seq:>5}  {name:>8}  {r['tokens_per_s_per_rank']:>13.1f}  {r['tokens_per_s_per_rank'] / ref:>7.2f}  "
                  f"{r['first_loss']:>10.5f}")
            rows.append({"seq_len": seq, "layout": name, **r, "ratio_to_fsdp": r["tokens_per_s_per_rank"] / ref})
    for name in results:
        peak = results[name]["peak_added_bytes"]
        print(f"peak memory added in training, max over ranks: {name:>8} {peak / 2**20:8.1f} MiB "
              f"({peak / max(results['fsdp']['peak_added_bytes'], 1):.2f}x fsdp)")
    for name in results:
        print(f"save_pretrained (durable, median of 3, slowest rank): {name:>8} {results[name]['save_s']:6.3f} s "
              f"({results[name]['save_s'] / results['fsdp']['save_s']:.2f}x fsdp)")
    path = harness.write_results("nd", argv, rows=rows,
                                 peak_added_bytes={n: results[n]["peak_added_bytes"] for n in results},
                                 save_s={n: results[n]["save_s"] for n in results})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
