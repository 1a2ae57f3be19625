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


def launch_trainer(tmp: Path, name: str, max_steps: int, *extra: str, launch_args: tuple = ()) -> dict:
    """The same Trainer script under `accelerate launch --config_file accelerate_configs/fsdp2.yaml`
    and no `--fsdp` flag: how libraries built on the Trainer document FSDP."""
    report = tmp / f"{name}.json"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "accelerate_configs" / "fsdp2.yaml"), "--num_processes", "2",
           "--main_process_port", str(free_port()), *launch_args, str(SCRIPT), "--report", str(report),
           "--output_dir", str(tmp / name), "--max_steps", str(max_steps),
           "--per_device_train_batch_size", str(GLOBAL_BATCH // 2), "--learning_rate", "1e-2",
           "--lr_scheduler_type", "constant", "--logging_steps", "1", "--report_to", "none",
           "--disable_tqdm", "true", "--save_strategy", "no", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    out = json.loads(report.read_text())
    out["losses"] = [out["losses"][str(i)] for i in range(1, max_steps + 1)]
    return out


def test_trainer_script_under_accelerate_launch_is_sharded_on_cpu(tmp_path):
    """Issue: on a CPU-only machine this ran two unsynchronised unsharded copies, silently."""
    out = launch_trainer(tmp_path, "launched", 3)
    assert out["all_dtensor"] and out["world"] == 2
    # Same data order and optimizer as the single-process reference (AdamW, lr 1e-2, constant).
    single = train(tmp_path, "single", 1, 3, "--save_strategy", "no")
    assert out["losses"] == pytest.approx(single["losses"], abs=1e-4)
    # bf16 on CPU: runs (CPU autocast) instead of stopping at the Trainer's GPU check.
    bf16 = launch_trainer(tmp_path, "bf16", 2, "--bf16", "true")
    assert bf16["all_dtensor"] and bf16["losses"][0] == pytest.approx(out["losses"][0], abs=5e-2)
