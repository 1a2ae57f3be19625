"""The longest sequence one rank trains within a fixed memory budget, at Llama-3.2-1B's widths (issue 63), measured on
one simulated rank: none, ring CP, Ulysses, Ulysses + tiling.

    python benchmarks/sequence_budget.py                          # 4 and 2 ranks, 2 layers, 4 GiB (~20 min, 2 cores)
    python benchmarks/sequence_budget.py --worlds 4 --modes none ulysses_tiled --budget-gib 6

Four real ranks of even 2 of the model's 16 layers hold ~13 GB on this 24 GiB machine and share its 2 cores, so the
memory side runs `hf-fsdp2 simulate`'s route (hf_fsdp2/tools/simulate.py): rank 0 of an N-rank job in a process of
its own under torch's fake process group, every tensor in its real per-rank shape, collectives moving nothing. The
model: Llama-3.2-1B's widths (hidden 2048, intermediate 8192, 32 heads, 8 KV heads, vocabulary 128256, tied
embeddings) with --layers of its 16 layers (CPU time), random weights, fp32 master weights computed in bf16
(param_dtype), AdamW, batch 1. Modes, FSDP2 over all N ranks:
  none           every rank a whole sequence (sp 1, cp 1)
  ring_cp        cp_size = N: torch's ring attention, the mesh and the split as Accelerate's launch makes them
  ulysses        sp_size = N (sharding/sequence_parallel.py)
  ulysses_tiled  sp_size = N with loss_tile_size and mlp_tile_size (sharding/sequence_tiling.py)
A point is one optimizer step (forward, backward, AdamW) at one length; its memory is glibc's live heap peak over the
level before the model (read after every op of the step: the heap probe), RSS beside it, and the planner's estimate
for the same setup. Per mode the length doubles from --start-per-rank x (sp or cp) until a point exceeds the budget,
then one bisection step between the longest that fit and the first that did not. A point whose predicted CPU time
(the last step's x 2.5 per doubling) exceeds --point-limit-s is not run: the mode is reported as fitting "at least"
its longest measured length, with that point's heap; nothing beyond a measured point is claimed.
Below a length that depends on the mode, a step's peak is a floor that does not grow with the sequence (the same in
every mode: 2.68 GiB at 4 ranks, 2 layers); the per-token heap is the slope between the two longest points above it.
--layer-slope also runs --layers - 1 layers at the longest fitting length of each mode named (world --worlds[0]):
the heap one layer adds there, less that layer's fp32 parameter shard, over the rank's tokens is the per-layer share of
the per-token heap; the rest of the slope (logits, loss) does not grow with layers. What the 16 layers of the real
model would hold per token follows from the two, labelled as derived: not a run at 16 layers.
--analyze PATH prints the table and these numbers from a results file again.
Writes benchmarks/results/sequence_budget-<stamp>.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

MODES = ("none", "ring_cp", "ulysses", "ulysses_tiled")
LLAMA32_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
                  num_key_value_heads=8, tie_word_embeddings=True, rope_theta=500000.0)
GROWTH = 2.5  # a doubling's step time: linear layers x 2, attention x 4 (a small share at these lengths)


def _config(layers: int, max_len: int):
    from transformers import AutoConfig

    return AutoConfig.for_model("llama", num_hidden_layers=layers, max_position_embeddings=max_len, **LLAMA32_1B)


def _fsdp2(mode: str, world: int, args) -> dict:
    layout = {"none": {}, "ring_cp": {"cp_size": world}, "ulysses": {"sp_size": world},
              "ulysses_tiled": {"sp_size": world, "loss_tile_size": args.loss_tile, "mlp_tile_size": args.mlp_tile}}
    return {"param_dtype": args.param_dtype, **layout[mode]}


def point(mode: str, world: int, seq: int, layers: int, args) -> dict:
    """One optimizer step of rank 0 at `seq` tokens, in a process of its own."""
    from hf_fsdp2 import FSDP2Config
    from hf_fsdp2.tools.simulate import simulate_ranks

    start = time.perf_counter()
    (report,) = simulate_ranks([0], _config(layers, args.max_len), world, FSDP2Config(**_fsdp2(mode, world, args)),
                               seq_len=seq, steps=1)
    row = {"seq": seq, "layers": layers, "heap_live_peak": report.heap_live_peak, "rss_peak": report.rss_peak,
           "estimate": report.estimate_device_bytes, "step_s": report.step_s[0],
           "wall_s": time.perf_counter() - start, "fits": report.heap_live_peak <= args.budget_gib * 2**30}
    print(f"  {mode:>13} x{world} L{layers} {seq:>6} tokens: heap {row['heap_live_peak'] / 2**30:5.2f} GiB, RSS "
          f"{row['rss_peak'] / 2**30:5.2f}, estimate {row['estimate'] / 2**30:5.2f}, step {row['step_s']:6.1f} s "
          f"{'fits' if row['fits'] else 'over'}", flush=True)
    return row


def search(mode: str, world: int, args) -> dict:
    """Doubling, then one bisection step; stops where CPU time would pass --point-limit-s."""
    split = world if mode != "none" else 1
    grain = 2 * split * 256  # ring CP's load balancing cuts each sequence into 2 x cp chunks
    seq, points, fit, over, limited = args.start_per_rank * split, [], None, None, None
    while seq <= args.max_len:
        row = point(mode, world, seq, args.layers, args)
        points.append(row)
        if not row["fits"]:
            over = seq
            break
        fit = seq
        if row["step_s"] * GROWTH > args.point_limit_s:
            limited = f"{2 * seq} tokens not run: ~{row['step_s'] * GROWTH:.0f} s predicted > {args.point_limit_s} s"
            break
        seq *= 2
    if fit is not None and over is not None:
        mid = (fit + over) // 2 // grain * grain
        if fit < mid < over:
            row = point(mode, world, mid, args.layers, args)
            points.append(row)
            fit, over = (mid, over) if row["fits"] else (fit, mid)
    bound = "at least" if over is None else "measured"
    return {"points": points, "longest": fit or 0, "bound": bound, "first_over": over, "limited": limited}


def layer_slope(mode: str, world: int, found: dict, args) -> dict | None:
    """The longest fitting length again with one layer fewer."""
    if not found["longest"] or args.layers < 2:
        return None
    return {"points": [point(mode, world, found["longest"], args.layers - 1, args)]}


def _layer_shard_bytes(world: int) -> int:
    """One decoder layer's fp32 parameter shard on a rank (what one layer fewer removes besides activations)."""
    import torch
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        layer = LlamaForCausalLM(_config(1, 4096)).model.layers[0]
    return sum(p.numel() for p in layer.parameters()) * 4 // world


def derive(mode: str, world: int, found: dict, fewer: list[dict] | None, layers: int) -> dict:
    """Per rank-token heap above the floor, and its per-layer and layer-independent shares (see the docstring)."""
    split = world if mode != "none" else 1
    floor = min(row["heap_live_peak"] for row in found["points"])
    above = sorted((row for row in found["points"] if row["heap_live_peak"] > 1.02 * floor), key=lambda r: r["seq"])
    out = {"floor_bytes": floor}
    if len(above) >= 2:
        a, b = above[-2:]
        out["per_rank_token_bytes"] = (b["heap_live_peak"] - a["heap_live_peak"]) / ((b["seq"] - a["seq"]) / split)
        out["slope_between"] = [a["seq"], b["seq"]]
    full = {row["seq"]: row for row in found["points"]}
    one = next((row for row in fewer or [] if row["seq"] == found["longest"]), None)
    if one is not None and full[one["seq"]]["heap_live_peak"] > 1.02 * floor and "per_rank_token_bytes" in out:
        added = full[one["seq"]]["heap_live_peak"] - one["heap_live_peak"] - _layer_shard_bytes(world)
        out["per_layer_per_token_bytes"] = per_layer = added / (one["seq"] / split)
        out["layer_independent_per_token_bytes"] = rest = out["per_rank_token_bytes"] - layers * per_layer
        out["derived_16_layers_per_token_bytes"] = rest + 16 * per_layer
    return out


def report(results: dict, slopes: dict, layers: int, budget_gib: float, param_dtype: str) -> None:
    print(f"\nLlama-3.2-1B widths, {layers} of 16 layers, {param_dtype} compute over fp32 masters, AdamW; "
          f"rank 0's live heap within {budget_gib} GiB (simulated rank, one step a point)")
    for world, modes in results.items():
        none = modes.get("none", {}).get("longest") or 0
        for mode, r in modes.items():
            ratio = f" = {r['longest'] / none:.1f}x none" if none and r["longest"] else ""
            last = next(row for row in reversed(r["points"]) if row["seq"] == r["longest"]) if r["longest"] else None
            heap = f", heap {last['heap_live_peak'] / 2**30:.2f} GiB" if last else ""
            print(f"{world} ranks {mode:>13}: {r['bound']} {r['longest']:>6} tokens{ratio}{heap}"
                  + (f" ({r['limited']})" if r["limited"] else "")
                  + (f"; {r['first_over']} over" if r["first_over"] else ""))
    first = next(iter(results))
    for mode, s in slopes.items():
        d = derive(mode, int(first), results[first][mode], (s or {}).get("points"), layers)
        line = f"{mode} ({first} ranks): floor {d['floor_bytes'] / 2**30:.2f} GiB"
        if "per_rank_token_bytes" in d:
            line += f"; {d['per_rank_token_bytes'] / 1024:.0f} KiB per rank-token above it ({d['slope_between']})"
        if "per_layer_per_token_bytes" in d:
            line += (f" = {d['per_layer_per_token_bytes'] / 1024:.0f} KiB a layer x {layers} + "
                     f"{d['layer_independent_per_token_bytes'] / 1024:.0f} KiB not growing with layers; derived at 16 "
                     f"layers: {d['derived_16_layers_per_token_bytes'] / 1024:.0f} KiB")
        print(line)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[4, 2])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--layers", type=int, default=2, help="of Llama-3.2-1B's 16 (CPU time)")
    ap.add_argument("--budget-gib", type=float, default=4.0, help="rank 0's live heap peak, GiB")
    ap.add_argument("--param-dtype", default="bfloat16", help="compute dtype over fp32 master weights")
    ap.add_argument("--loss-tile", type=int, default=512)
    ap.add_argument("--mlp-tile", type=int, default=1024)
    ap.add_argument("--start-per-rank", type=int, default=1024, help="first length = this x (sp or cp)")
    ap.add_argument("--max-len", type=int, default=131072)
    ap.add_argument("--point-limit-s", type=float, default=240.0, help="skip a point predicted to step longer")
    ap.add_argument("--layer-slope", nargs="*", default=["none", "ulysses_tiled"], choices=MODES,
                    help="modes whose per-layer share is measured with one layer fewer (first world only)")
    ap.add_argument("--analyze", metavar="PATH", help="print the table of a results file; runs nothing")
    args = ap.parse_args(argv)
    if args.analyze:
        import json

        saved = json.loads(Path(args.analyze).read_text())
        report(saved["results"], saved["layer_slope"], saved["shape"]["num_hidden_layers"],
               saved["budget_bytes"] / 2**30, saved["param_dtype"])
        return 0
    started = time.perf_counter()
    results: dict = {}
    for world in args.worlds:
        results[world] = {}
        for mode in args.modes:
            print(f"{mode}, {world} ranks", flush=True)
            results[world][mode] = search(mode, world, args)
    slopes = {}
    for mode in args.layer_slope:
        if mode in results.get(args.worlds[0], {}):
            slopes[mode] = layer_slope(mode, args.worlds[0], results[args.worlds[0]][mode], args)
    report({str(w): m for w, m in results.items()}, slopes, args.layers, args.budget_gib, args.param_dtype)
    path = harness.write_results("sequence_budget", argv, budget_bytes=int(args.budget_gib * 2**30),
                                 shape={**LLAMA32_1B, "num_hidden_layers": args.layers},
                                 param_dtype=args.param_dtype, loss_tile=args.loss_tile, mlp_tile=args.mlp_tile,
                                 results={str(w): m for w, m in results.items()}, layer_slope=slopes,
                                 wall_s=time.perf_counter() - started)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
