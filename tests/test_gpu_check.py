"""benchmarks/gpu_check.py's dry run: every section of the GPU check on CPU with tiny shapes, so the script
the GPU machine runs cannot rot between the rare sessions that have one (issue 53)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run_runs_every_section(tmp_path):
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--dry-run", "--out", str(tmp_path),
                          "--tmp", str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    sections = result["sections"]
    assert list(sections) == ["equality", "checkpoint", "throughput", "save_load", "generate", "variants",
                              "two_process"]
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
                        "regional_compile", "fp8", "compile_model"}
    assert sections["two_process"]["gloo_cpu"]["ran"]
    assert {t["target"] for t in result["targets"]} >= {"full: ours / plain tokens/s", "fp8 / bf16 tokens/s"}
    table = (tmp_path / "gpu_check.txt").read_text()
    assert "targets:" in table and table in out.stdout
