"""benchmarks/gpu_check.py's dry run: every section of the GPU check on CPU with tiny shapes, so the script
the GPU machine runs cannot rot between the rare sessions that have one (issue 53)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run_runs_every_section(tmp_path):
    # A budget that lets every section run, however slow the CPU: ~6-8 minutes on 2 shared cores (the default 450 s
    # skipped the last section's cases there).
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--dry-run", "--out", str(tmp_path),
                          "--tmp", str(tmp_path), "--rounds", "1", "--budget-s", "800"],
                         capture_output=True, text=True, timeout=900, cwd=REPO)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    sections = result["sections"]
    assert list(sections) == ["equality", "checkpoint", "simulate", "moe", "throughput", "save_load", "generate", "variants",
                              "two_process", "local_ranks", "memory_phases", "fp8_large"]
    assert not [n for n, s in sections.items() if "error" in s or s.get("skipped")], sections
    # Correctness sections decide for themselves: plain PyTorch vs hf_fsdp2, stock reloads.
    assert sections["equality"]["ok"] and len(sections["equality"]["cases"]) == 4
    assert sections["checkpoint"]["ok"] and len(sections["checkpoint"]["checks"]) == 11
    assert sections["save_load"]["reloaded_equal"]
    assert all(r["same_tokens"] for k, r in sections["generate"].items() if k.endswith("new_tokens"))
    # Every contestant and variant measured (numbers on 2 CPU cores mean nothing; that they exist does).
    for mode in ("full", "lora"):
        for name in ("plain", "ours", "ours_fsdp2", "accelerate"):
            assert sections["throughput"][mode][name]["tokens_per_s"] > 0, (mode, name)
        assert sections["throughput"][mode]["ours"]["estimate_bytes"] > 0
    measured = {k for k, v in sections["variants"].items() if isinstance(v, dict) and "tokens_per_s" in v}
    assert measured == {"eager", "activation_checkpointing", "op_level_checkpointing", "activation_offload",
                        "regional_compile", "fp8", "fp8_regional_compile", "compile_model"}
    assert sections["two_process"]["gloo_cpu"]["ran"]
    # ranks as threads (on the GPU: 2 and 4 ranks; here 2): equal to one process, rows saved and loaded, EP
    assert sections["local_ranks"]["ok"] and set(sections["local_ranks"]["results"]) == {"train_save_load_2",
                                                                                        "expert_parallel_2"}
    for case in ("llama31_8b_full", "qwen3_30b_a3b_lora_ep8", "llama31_70b_qlora"):  # one rank of 4, first and last
        simulated = sections["simulate"][case]
        assert [r["rank"] for r in simulated["ranks"]] == [0, 3], simulated
        assert simulated["predicted_tokens_per_s_per_gpu"] > 0
    assert "nf4" in sections["simulate"]["llama31_70b_qlora"]["ranks"][0]["setup"]
    # MoE at world size 1: both contestants, LoRA and full; FP8 experts (emulated MXFP8 on CPU) against bf16
    moe = sections["moe"]
    assert set(moe["world_one"]["ratios"]) == {"lora", "full"} and all(r > 0 for r in moe["world_one"]["ratios"].values())
    assert moe["fp8_experts"]["ratios"]["mxfp8_emulated"]["step"] > 0
    assert "lora: hf_fsdp2 / transformers' experts" in (tmp_path / "gpu_check.txt").read_text()
    phases = {k: v for k, v in sections["memory_phases"].items() if isinstance(v, dict)}
    assert set(phases) == {"lora/plain", "lora/ours_fsdp2", "lora/accelerate", "full/ours_fsdp2", "full/accelerate"}
    assert all(r["saved_bytes"] > 0 for r in phases.values()), phases
    assert sections["fp8_large"]["fp8_speedup"] > 0
    assert {t["target"] for t in result["targets"]} >= {"full: ours / plain tokens/s", "fp8 / bf16 tokens/s (eager)",
                                                        "fp8 / bf16 tokens/s (regional compile)"}
    table = (tmp_path / "gpu_check.txt").read_text()
    assert "targets:" in table and table in out.stdout


def test_peak_sites_replays_an_allocator_trace():
    """The memory_phases section's reading of a CUDA allocator trace (CUDA-only, so checked here on a made-up one):
    the peak is the highest point of the bytes allocated, and what was live there is summed by library frame."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from gpu_check import peak_sites

    frame = lambda f, line: [{"filename": f"/x/site-packages/{f}", "line": line, "name": "fn"}]  # noqa: E731
    trace = [{"action": "alloc", "addr": 1, "size": 100, "frames": frame("peft/tuners/lora/layer.py", 7)},
             {"action": "alloc", "addr": 2, "size": 50, "frames": frame("transformers/loss/loss_utils.py", 3)},
             {"action": "free_completed", "addr": 2, "size": 50},
             {"action": "alloc", "addr": 3, "size": 30, "frames": frame("peft/tuners/lora/layer.py", 7)},
             {"action": "alloc", "addr": 4, "size": 40, "frames": []},
             {"action": "free_requested", "addr": 1, "size": 100}]
    got = peak_sites(trace)
    assert got["peak_during_step"] == 170 and got["at_event"] == 4
    assert got["sites"] == [{"site": "peft/tuners/lora/layer.py:7:fn", "bytes": 130}, {"site": "other", "bytes": 40}]
