"""Long sequences on a fixed per-rank memory budget: no sequence split, ring CP, Ulysses SP, Ulysses + tiling.

    python benchmarks/sequence_bench.py [--world-size 2] [--budget-mib 384] [--vocab 32000] [--hidden 256]
    python benchmarks/sequence_bench.py --shape llama32_1b --layers 2 --param-dtype bfloat16 --world-size 4 \
        --speed-only --speed-len 4096 --speed-modes ulysses ulysses_tiled     # tokens/s at Llama-3.2-1B's widths

Same random Llama (a large vocabulary on a small body: the logits are most of a long sequence's activations),
one sequence per data-parallel group, FSDP2 over all ranks; each mode in its own ranks:
  none           every rank a whole sequence (FSDP2 alone)
  ring_cp        cp_size = world: torch's context_parallel ring attention (labels shifted before the split)
  ulysses        sp_size = world (sharding/sequence_parallel.py, the batch split by hf_fsdp2.local_batch)
  ulysses_tiled  sp_size = world with loss_tile_size and mlp_tile_size (sharding/sequence_tiling.py)
  ulysses_ring   sp_size = world / 2 within cp_size = 2 (Ulysses inside torch's ring attention; 4 ranks or more)
For each mode the sequence doubles from --start until one training step (forward + backward) adds more than the
budget to a rank's peak resident memory (VmHWM reset before the step, glibc's free memory trimmed); the longest
that fit is reported, and the tokens/s of ring CP and Ulysses (and Ulysses within ring CP, on 4 ranks or more) at
the same length (--speed-len, median of --steps, their steps alternating in the same ranks so that a shared
machine's load falls on all alike).
--shape llama32_1b: Llama-3.2-1B's widths (hidden 2048, intermediate 8192, 32 heads, 8 KV heads, vocabulary 128256,
tied embeddings) with --layers of its layers, built on the meta device so that each rank allocates its own rows only
(shard_model runs the model's init on them); its memory side is benchmarks/sequence_budget.py (a simulated rank), this
script's --speed-only measures its tokens/s on real ranks. --param-dtype: compute dtype over fp32 master weights.
Writes benchmarks/results/sequence-<stamp>.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

MODES = ("none", "ring_cp", "ulysses", "ulysses_tiled", "ulysses_ring")
SPEED_MODES = ("ulysses", "ulysses_tiled", "ulysses_ring")  # each timed against ring CP
LLAMA32_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
                  num_key_value_heads=8, tie_word_embeddings=True, rope_theta=500000.0)


def _model(args):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if getattr(args, "shape", "small") == "llama32_1b":  # on meta: shard_model allocates and inits each rank's rows
        config = LlamaConfig(num_hidden_layers=args.layers, max_position_embeddings=max(args.max_len, args.speed_len),
                             **LLAMA32_1B)
        with torch.device("meta"):
            return LlamaForCausalLM(config)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 4,
                         num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=8,
                         max_position_embeddings=args.max_len, tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def _settings(args, **layout):
    """FSDP2Config of a mode: its layout, and --param-dtype (compute dtype over fp32 masters) where given."""
    import hf_fsdp2

    dtype = getattr(args, "param_dtype", None)
    return hf_fsdp2.FSDP2Config(**layout, **({"param_dtype": dtype} if dtype else {}))


def run_job(rank: int, world: int, job: dict) -> dict:
    import torch
    import torch.distributed as dist

    import hf_fsdp2

    args, mode = argparse.Namespace(**job["args"]), job["mode"]
    model = _model(args)
    mesh = None
    if mode == "ring_cp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel

        mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp_shard", "cp"))
        hf_fsdp2.shard_model(model, _settings(args, cp_size=world), mesh=mesh)
    elif mode == "ulysses_ring":
        hf_fsdp2.shard_model(model, _settings(args, sp_size=world // 2, cp_size=2))
    else:
        tiles = _tiles(args) if mode == "ulysses_tiled" else {}
        hf_fsdp2.shard_model(model, _settings(args, sp_size=1 if mode == "none" else world, **tiles))
    model.train()

    def step(seq: int, seed: int) -> float:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, args.vocab, (1, seq), generator=g)
        dist.barrier()
        start = time.perf_counter()
        if mode == "ring_cp":
            labels = ids.clone()
            shift = torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:].contiguous()
            positions = torch.arange(seq).expand_as(ids).clone()
            items = (shift != -100).sum() / world  # the cp ranks' losses are averaged by FSDP2's reduction
            buffers = [ids, labels, shift, positions]
            with context_parallel(mesh["cp"], buffers=buffers, buffer_seq_dims=[1] * 4,
                                  no_restore_buffers=set(buffers)):
                model(input_ids=ids, labels=labels, shift_labels=shift, position_ids=positions,
                      num_items_in_batch=items).loss.backward()
        elif mode == "none" and rank:  # FSDP2 alone: each rank its own whole sequence (another one)
            model(input_ids=ids.roll(1, 1), labels=ids.roll(1, 1)).loss.backward()
        else:
            batch = hf_fsdp2.local_batch({"input_ids": ids, "labels": ids}, model)
            model(**batch).loss.backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    out = {"fits": {}, "peak_bytes": {}}
    seq = args.start
    while seq <= args.max_len:
        harness.malloc_trim()
        base = harness.rss_bytes()
        harness.reset_hwm()
        step(seq, seq)
        peak = harness.hwm_bytes() - base
        worst = torch.tensor(peak, dtype=torch.int64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        out["peak_bytes"][seq] = int(worst)
        fits = int(worst) <= args.budget_mib * 2**20
        out["fits"][seq] = fits
        if not fits:
            break
        seq *= 2
    return out


def _tiles(args) -> dict:
    loss = getattr(args, "loss_tile", None) or args.tile
    return {"loss_tile_size": loss, "mlp_tile_size": args.tile}


def speed_job(rank: int, world: int, job: dict) -> dict:
    """Ring CP and Ulysses at the same length, their steps alternating in the same ranks (a shared machine's load
    falls on both alike): median seconds of a forward + backward."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    import hf_fsdp2

    args, seq = argparse.Namespace(**job["args"]), job["args"]["speed_len"]
    ring = _model(args)
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp_shard", "cp"))
    hf_fsdp2.shard_model(ring, _settings(args, cp_size=world), mesh=mesh)
    speed_modes = getattr(args, "speed_modes", None) or ["ulysses", "ulysses_ring"]
    layouts = {"ulysses": {"sp_size": world}, "ulysses_tiled": {"sp_size": world, **_tiles(args)},
               "ulysses_ring": {"sp_size": world // 2, "cp_size": 2}}
    models = {mode: hf_fsdp2.shard_model(_model(args), _settings(args, **layouts[mode])) for mode in speed_modes
              if mode != "ulysses_ring" or world >= 4}
    for model in (ring, *models.values()):
        model.train()
    times: dict[str, list[float]] = {"ring_cp": [], **{mode: [] for mode in models}}
    g = torch.Generator().manual_seed(7)
    for _ in range(args.steps):
        ids = torch.randint(0, args.vocab, (1, seq), generator=g)
        for mode in times:
            dist.barrier()
            start = time.perf_counter()
            if mode == "ring_cp":
                x, labels = ids.clone(), ids.clone()
                shift = torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:].contiguous()
                positions = torch.arange(seq).expand_as(ids).clone()
                buffers = [x, labels, shift, positions]
                with context_parallel(mesh["cp"], buffers=buffers, buffer_seq_dims=[1] * 4,
                                      no_restore_buffers=set(buffers)):
                    ring(input_ids=x, labels=labels, shift_labels=shift, position_ids=positions,
                         num_items_in_batch=(shift != -100).sum() / world).loss.backward()
                ring.zero_grad(set_to_none=True)
            else:
                model = models[mode]
                model(**hf_fsdp2.local_batch({"input_ids": ids, "labels": ids}, model)).loss.backward()
                model.zero_grad(set_to_none=True)
            times[mode].append(time.perf_counter() - start)
    return {"median_s": {mode: statistics.median(t[1:]) for mode, t in times.items()}, "step_s": times}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--budget-mib", type=int, default=384)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tile", type=int, default=512, help="loss_tile_size and mlp_tile_size of ulysses_tiled")
    ap.add_argument("--loss-tile", type=int, default=None, help="loss_tile_size of ulysses_tiled (default --tile)")
    ap.add_argument("--shape", choices=("small", "llama32_1b"), default="small",
                    help="small: --hidden/--vocab, 8 heads, untied; llama32_1b: Llama-3.2-1B's widths, --layers")
    ap.add_argument("--param-dtype", default=None, help="compute dtype over fp32 master weights (default fp32)")
    ap.add_argument("--speed-modes", nargs="+", default=["ulysses", "ulysses_ring"], choices=SPEED_MODES,
                    help="timed against ring CP at --speed-len (ulysses_ring: 4 ranks or more)")
    ap.add_argument("--speed-only", action="store_true", help="no memory search: tokens/s at --speed-len only")
    ap.add_argument("--start", type=int, default=512)
    ap.add_argument("--max-len", type=int, default=32768)
    ap.add_argument("--speed-len", type=int, default=2048, help="tokens/s of ring CP and Ulysses at this length")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    args = ap.parse_args(argv)
    if args.world_size < 4 and "ulysses_ring" in args.modes:  # sp x cp needs 2 x 2 ranks at least
        args.modes.remove("ulysses_ring")
    threads = max(1, (os.cpu_count() or 1) // args.world_size)
    if args.shape == "llama32_1b":
        args.vocab, args.hidden = LLAMA32_1B["vocab_size"], LLAMA32_1B["hidden_size"]
    results = {}
    for mode in [] if args.speed_only else args.modes:
        ranks = harness.run_ranks(run_job, args.world_size, {"args": vars(args), "mode": mode}, timeout=3600,
                                  threads=threads)
        results[mode] = ranks[0]
        fitting = [s for s, ok in results[mode]["fits"].items() if ok]
        results[mode]["longest"] = max(fitting) if fitting else 0
    print(f"Llama {args.layers} layers, hidden {args.hidden}, vocab {args.vocab} ({args.shape}); {args.world_size} "
          f"ranks, {threads} threads each; compute {args.param_dtype or 'float32'}; budget {args.budget_mib} MiB per "
          "rank (a step's added peak RSS)")
    none = results.get("none", {}).get("longest") or 0
    for mode, r in results.items():
        peaks = ", ".join(f"{s}: {b / 2**20:.0f}" for s, b in r["peak_bytes"].items())
        ratio = f" ({r['longest'] / none:.0f}x none)" if none else ""
        print(f"{mode:>14}: longest {r['longest']:>6} tokens{ratio}   peak MiB by length: {peaks}")
    speed, speed_steps = {}, {}
    if args.speed_len:
        timed = harness.run_ranks(speed_job, args.world_size, {"args": vars(args)}, timeout=3600, threads=threads)[0]
        speed_steps = timed["step_s"]
        for mode, seconds in timed["median_s"].items():
            speed[mode] = args.speed_len / seconds
            print(f"{mode:>14}: {speed[mode]:.0f} tokens/s at {args.speed_len} tokens (forward + backward, median of "
                  f"{args.steps - 1}, the two alternating in the same ranks)")
    path = harness.write_results("sequence", argv, budget_mib=args.budget_mib, world_size=args.world_size,
                                 threads_per_rank=threads,
                                 shape={"name": args.shape, "layers": args.layers, "hidden": args.hidden,
                                        "vocab": args.vocab, "tile": args.tile,
                                        "loss_tile": args.loss_tile or args.tile},
                                 param_dtype=args.param_dtype, speed_step_s=speed_steps,
                                 longest={m: r["longest"] for m, r in results.items()},
                                 peak_bytes={m: r["peak_bytes"] for m, r in results.items()},
                                 tokens_per_s={**speed, "seq_len": args.speed_len})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
