"""FP8 experts vs bf16 experts (issue 64: FP8 experts >= 1.2x bf16 experts' tokens/s on one H200), world size 1.

    python benchmarks/moe_fp8.py                 # CUDA: Qwen3-30B-A3B-shaped MoE layers, bf16 vs rowwise FP8
    python benchmarks/moe_fp8.py --tiny          # CPU: a tiny shape, bf16 vs emulated MXFP8 (reaches the code only)

`run(...)` returns a dict (the GPU check calls it): for each contestant the training step's tokens/s (forward,
backward, AdamW), the forward + backward alone, peak CUDA memory and the losses; and each FP8 contestant's ratio
to bf16. Contestants, each a fresh model of the same seed sharded by `shard_model` at world size 1 with bf16 compute
over fp32 master weights (`param_dtype="bf16"`):

  bf16       the experts as transformers runs them by default (`grouped_mm_experts_forward`, `_grouped_mm`)
  rowwise    `fp8_experts="rowwise"`: torchao's rowwise FP8 grouped matmuls (CUDA capability >= 9.0)
  mxfp8      `fp8_experts="mxfp8"` (capability >= 10.0; refused by name on an H200, recorded as such)
  mxfp8_emulated  the CPU mode (--tiny): MXFP8's numbers through a bf16 grouped matmul, not a speed

The shape is Qwen3-30B-A3B's MoE layer (hidden 2048, 128 experts of 768, top 8, 32 query / 4 key-value heads of
128) with `layers` layers and a small vocabulary (1024: the lm_head's cost is not the experts'); the router's random
initialisation spreads tokens about evenly over the experts. `lora=True`: PEFT LoRA (r 16) on the fused experts with
the base frozen (sharding/expert_parallel/grouped.py runs it inside the grouped matmuls; FP8 on the frozen base).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # hf_fsdp2 from this checkout

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

QWEN3_30B_A3B = dict(hidden_size=2048, moe_intermediate_size=768, intermediate_size=6144, num_experts=128,
                     num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128)
TINY = dict(hidden_size=64, moe_intermediate_size=32, intermediate_size=128, num_experts=8, num_experts_per_tok=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16)
EXPERT_TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
TARGET = 1.2  # issue 64: FP8 experts >= 1.2x bf16 experts


def _world_one(device: torch.device) -> bool:
    """A one-rank process group (NCCL on a GPU, gloo on CPU) unless one exists; whether it made it."""
    if dist.is_initialized():
        return False
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                      LOCAL_WORLD_SIZE="1")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    import hf_fsdp2

    hf_fsdp2.init_distributed()
    return True


def build(shape: dict, layers: int, vocab: int, device: torch.device, lora: bool, seed: int = 0):
    """A Qwen3-MoE model of `shape` with `layers` MoE layers, fp32, on `device` (LoRA on its experts if `lora`)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(**shape, vocab_size=vocab, num_hidden_layers=layers, max_position_embeddings=8192,
                            tie_word_embeddings=False, output_router_logits=False, attn_implementation="sdpa")
    with torch.device(device):
        model = Qwen3MoeForCausalLM(config).float()
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(seed + 1)
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_parameters=EXPERT_TARGETS))
    return model


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def contestant(mode: str, shape: dict, layers: int, vocab: int, batch: int, seq: int, steps: int, warmup: int,
               device: torch.device, lora: bool) -> dict:
    """One contestant's training steps: tokens/s of the whole step and of forward + backward, peak memory."""
    from hf_fsdp2 import FSDP2Config, shard_model

    model = build(shape, layers, vocab, device, lora)
    shard_model(model, FSDP2Config(param_dtype="bf16", fp8_experts=None if mode == "bf16" else mode))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    g = torch.Generator().manual_seed(1234)
    data = [torch.randint(0, vocab, (batch, seq), generator=g).to(device) for _ in range(warmup + steps)]
    losses, fwd_bwd, total = [], 0.0, 0.0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for i, ids in enumerate(data):
        _sync(device)
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        _sync(device)
        middle = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        if i >= warmup:
            fwd_bwd += middle - start
            total += time.perf_counter() - start
        losses.append(loss.item())
    tokens = batch * seq * steps
    out = {"tokens_per_s": tokens / total, "fwd_bwd_tokens_per_s": tokens / fwd_bwd, "step_s": total / steps,
           "losses": losses}
    if device.type == "cuda":
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
    del model, optimizer
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def run(device: str | None = None, *, tiny: bool = False, modes: tuple[str, ...] | None = None, lora: bool = False,
        layers: int = 2, batch: int = 4, seq: int = 4096, steps: int = 4, warmup: int = 2) -> dict:
    """bf16 experts vs each FP8 mode in `modes` (default: "rowwise" on CUDA, "mxfp8_emulated" on CPU), world size
    1, Qwen3-30B-A3B's MoE shape (`tiny`: a tiny one, 2 layers, 2 x 32 tokens, 1 step after 1). A contestant that fails
    (a mode refused on this device) is recorded with its error. Returns the shape, each contestant, each FP8 mode's
    ratio to bf16 (whole step and forward + backward) and whether the step's ratio meets the target."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if tiny:
        shape, layers, batch, seq, steps, warmup, vocab = TINY, 2, 2, 32, 1, 1, 128
    else:
        shape, vocab = QWEN3_30B_A3B, 1024
    modes = modes or (("rowwise",) if device.type == "cuda" else ("mxfp8_emulated",))
    made = _world_one(device)
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "lora": lora,
              "shape": {**shape, "layers": layers, "vocab": vocab, "batch": batch, "seq": seq, "steps": steps,
                        "warmup": warmup}, "contestants": {}, "ratios": {}}
    try:
        for mode in ("bf16", *modes):
            try:
                result["contestants"][mode] = contestant(mode, shape, layers, vocab, batch, seq, steps, warmup,
                                                         device, lora)
            except Exception as error:  # noqa: BLE001 - recorded: a mode this device or build cannot run
                result["contestants"][mode] = {"error": f"{type(error).__name__}: {error}",
                                               "traceback": traceback.format_exc()[-3000:]}
        base = result["contestants"]["bf16"]
        for mode in modes:
            r = result["contestants"][mode]
            if "error" in r or "error" in base:
                continue
            result["ratios"][mode] = {"step": r["tokens_per_s"] / base["tokens_per_s"],
                                      "fwd_bwd": r["fwd_bwd_tokens_per_s"] / base["fwd_bwd_tokens_per_s"],
                                      "meets_target": r["tokens_per_s"] / base["tokens_per_s"] >= TARGET}
    finally:
        if made:
            dist.destroy_process_group()
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny shape (CPU: emulated MXFP8)")
    parser.add_argument("--lora", action="store_true", help="LoRA on the experts, base frozen")
    parser.add_argument("--modes", default=None, help="comma-separated fp8_experts modes (default per device)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default=None, help="write the JSON here too")
    args = parser.parse_args(argv)
    modes = tuple(args.modes.split(",")) if args.modes else None
    result = run(tiny=args.tiny, modes=modes, lora=args.lora, layers=args.layers, batch=args.batch, seq=args.seq,
                 steps=args.steps)
    text = json.dumps(result, indent=1, default=str)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0 if all("error" not in r for r in result["contestants"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
