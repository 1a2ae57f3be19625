"""The scripts the suite runs under a real launcher (tests/scripts/), and the single-process
references they are compared with: one place for the command lines, shared by every test module."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .common import GLOBAL_BATCH, batches, build_model, lora
from .dist_harness import accelerate_launch, run_launched, torchrun

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "accelerate_configs"
ACCEL_SCRIPT = ROOT / "tests" / "scripts" / "accel_train.py"
TRAINER_SCRIPT = ROOT / "tests" / "scripts" / "trainer_train.py"


def launch(config: str, processes: int, out: Path, *script_args: str, launch_args: tuple = (), env=None,
           timeout: int = 300) -> dict:
    cmd = accelerate_launch(CONFIGS / config, *launch_args, processes=processes) + [
        str(ACCEL_SCRIPT), "--out", str(out), "--per-device-batch", str(GLOBAL_BATCH // processes), *script_args]
    run_launched(cmd, cwd=ROOT, env=env, timeout=timeout)
    return json.loads(out.read_text())


def reference_losses(steps: int = 5, use_lora: bool = False, model=None) -> list[float]:
    """tests/scripts/accel_train.py's loop on one process, on `model` (trained in place) or a new one."""
    if model is None:
        model = lora(build_model()) if use_lora else build_model()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    losses = []
    for ids in batches(steps=steps, batch=GLOBAL_BATCH):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def run_script(launcher: list[str], report: Path, output_dir: Path, processes: int, max_steps: int,
               *extra: str, env: dict | None = None) -> dict:
    """Run the Trainer script under `launcher` with the shared training arguments; its report."""
    cmd = [*launcher, str(TRAINER_SCRIPT), "--report", str(report), "--output_dir", str(output_dir),
           "--max_steps", str(max_steps), "--per_device_train_batch_size", str(GLOBAL_BATCH // processes),
           "--learning_rate", "1e-2", "--lr_scheduler_type", "constant", "--logging_steps", "1",
           "--report_to", "none", "--disable_tqdm", "true", *extra]
    run_launched(cmd, cwd=ROOT, env=env, timeout=300)
    out = json.loads(report.read_text())
    out["losses"] = [out["losses"][str(i)] for i in range(1, max_steps + 1)]
    return out


def train(tmp: Path, name: str, processes: int, max_steps: int, *extra: str, env: dict | None = None) -> dict:
    """torchrun with the Trainer's own flag: `--fsdp full_shard --fsdp_config accelerate_configs/fsdp2.json`."""
    launcher = torchrun(processes)
    return run_script(launcher, tmp / f"{name}.json", tmp / "out", processes, max_steps, "--fsdp", "full_shard",
                      "--fsdp_config", str(ROOT / "accelerate_configs" / "fsdp2.json"), *extra, env=env)



_SINGLE_TRAINER: dict[int, list[float]] = {}


def single_trainer_losses(tmp: Path, max_steps: int) -> list[float]:
    """The Trainer script's losses on one process (no checkpoints): the reference the launched
    layouts compare with, run once per session for each `max_steps`."""
    if max_steps not in _SINGLE_TRAINER:
        _SINGLE_TRAINER[max_steps] = train(tmp, "single", 1, max_steps, "--save_strategy", "no")["losses"]
    return _SINGLE_TRAINER[max_steps]


def trainer_under_launch(config: str, tmp: Path, max_steps: int = 3) -> dict:
    """The Trainer script under `accelerate launch --config_file accelerate_configs/<config>` on 4
    processes of which 2 are data-parallel ranks (x 4 rows = the single process's 8)."""
    return run_script(accelerate_launch(CONFIGS / config, processes=4), tmp / "launched.json", tmp / "launched", 2,
                      max_steps, "--save_strategy", "no")
