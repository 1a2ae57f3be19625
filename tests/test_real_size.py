"""benchmarks/real_size.py's tiny mode: every phase of the real-size run (load through hf_fsdp2.from_pretrained,
steps, every save, resume) on tiny shapes, so the benchmark cannot rot (issue 51; its real shapes take tens of
minutes and are run by hand)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_real_size_tiny_mode_runs_every_phase():
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "real_size.py"), "--tiny"], capture_output=True,
                          text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    path = REPO / proc.stdout.strip().splitlines()[-1].removeprefix("results: ")
    try:
        results = json.loads(path.read_text())["results"]
    finally:
        path.unlink()  # a tiny run's numbers are no result
    assert set(results) == {"lora_1b", "full_qwen05b"}
    for name, r in results.items():
        phases = r["ranks"][0]["phases"]
        assert {"load", "train", "resume", "save_state"} <= set(phases), name
        assert r["resumed_max_loss_diff"] < 1e-5, name  # the resumed run continues the same way
        assert r["estimates"]["ours_device_bytes"] > 0 and r["train_peak_vs_estimate"] > 0
    assert {"save_adapter", "save_merged"} <= set(results["lora_1b"]["ranks"][0]["phases"])
    assert results["full_qwen05b"]["layout"]["shard_size"] == 2  # the budget only sharding fits
