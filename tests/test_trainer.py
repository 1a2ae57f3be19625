"""Transformers Trainer with `--fsdp full_shard --fsdp_config accelerate_configs/fsdp2.json` and
`hf_fsdp2.register()`: real torchrun launches on CPU, resume across process counts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .dist_harness import free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "trainer_train.py"
GLOBAL_BATCH = 8


def train(tmp: Path, name: str, processes: int, max_steps: int, *extra: str) -> dict:
    report = tmp / f"{name}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
           "--master_port", str(free_port()), str(SCRIPT), "--report", str(report),
           "--output_dir", str(tmp / "out"), "--fsdp", "full_shard",
           "--fsdp_config", str(ROOT / "accelerate_configs" / "fsdp2.json"),
           "--max_steps", str(max_steps), "--per_device_train_batch_size", str(GLOBAL_BATCH // processes),
           "--learning_rate", "1e-2", "--lr_scheduler_type", "constant", "--logging_steps", "1",
           "--report_to", "none", "--disable_tqdm", "true", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    out = json.loads(report.read_text())
    out["losses"] = [out["losses"][str(i)] for i in range(1, max_steps + 1)]
    return out


@pytest.mark.parametrize("use_lora, before, after", [(False, 2, 1), (True, 1, 2)])
def test_checkpoint_and_resume_on_another_process_count(tmp_path, use_lora, before, after):
    flags = ("--lora", "true") if use_lora else ()
    whole = train(tmp_path, "whole", before, 6, "--save_strategy", "no", *flags)
    assert whole["all_dtensor"]
    first = train(tmp_path, "first", before, 3, "--save_strategy", "steps", "--save_steps", "3", *flags)
    ckpt = tmp_path / "out" / "checkpoint-3"
    names = {p.name for p in ckpt.iterdir()}
    weights = "adapter_model.safetensors" if use_lora else "model.safetensors"
    assert {weights, "optimizer.safetensors", "trainer_state.json", "COMPLETE.json"} <= names
    assert not [n for n in names if n.endswith((".pt", ".pth", ".bin", ".pkl"))]
    resumed = train(tmp_path, "resumed", after, 6, "--save_strategy", "no", "--resume", str(ckpt),
                    "--final_dir", str(tmp_path / "final"), *flags)
    assert resumed["world"] == after
    assert first["losses"] == pytest.approx(whole["losses"][:3], abs=1e-4)
    assert resumed["losses"][3:] == pytest.approx(whole["losses"][3:], abs=1e-4)
    # save_model under SHARDED_STATE_DICT (where stock Trainer writes no weights) writes a loadable model.
    if use_lora:
        from peft import PeftModel

        from .common import build_model

        PeftModel.from_pretrained(build_model(), tmp_path / "final")
    else:
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained(tmp_path / "final")
