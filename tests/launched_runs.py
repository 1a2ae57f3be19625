"""The scripts the suite runs under a launcher (tests/scripts/), and the single-process references they are
compared with: one place for the command lines, shared by every test module.

Two ways to run a script under a launcher: for real (`accelerate launch` / torchrun start the workers), or
`Forked`: the workers forked from the test harness's fork server with the environment the launcher would give
them (computed by Accelerate's own launch functions), which saves the launcher's and each worker's imports
(~10 CPU-s for two workers, ~17 for a Trainer's; most of the suite's time was these). Each shipped yaml and
launcher keeps at least one real launch; variations of it run forked."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch

from .common import GLOBAL_BATCH, batches, build_model, lora
from .dist_harness import (accelerate_launch, free_port, launcher_environment, run_launched, run_script_ranks,
                           torchrun)

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "accelerate_configs"
ACCEL_SCRIPT = ROOT / "tests" / "scripts" / "accel_train.py"
TRAINER_SCRIPT = ROOT / "tests" / "scripts" / "trainer_train.py"


@dataclass(frozen=True)
class Forked:
    """A launcher's workers forked from the test harness's fork server (tests/dist_harness.run_script_ranks):
    `worker_env` is what the launcher would hand them, `processes` how many it would start."""

    worker_env: dict
    processes: int


def forked_torchrun(processes: int, env: dict | None = None) -> Forked:
    """torchrun's workers: torchrun hands them its own environment plus the per-rank variables."""
    return Forked(launcher_environment(env), processes)


def forked_accelerate_launch(config: str | Path, processes: int, launch_args: tuple = (),
                             env: dict | None = None) -> Forked:
    """`accelerate launch --config_file config`'s workers (`launched_env`)."""
    return Forked(launched_env(config, processes, launch_args, env), processes)


def launched_env(config: str | Path, processes: int, launch_args: tuple = (), env: dict | None = None) -> dict:
    """The environment `accelerate launch --config_file config --num_processes N *launch_args` hands torchrun for
    its workers (the launcher itself running in `launcher_environment(env)`, as `run_launched` starts it),
    computed by Accelerate's own functions: `_validate_launch_command` (config file and defaults), then
    `prepare_multi_gpu_env`, which `multi_gpu_launcher` calls for every yaml here (`use_fsdp`)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import launch as launch_utils

    with mock.patch.dict(os.environ, launcher_environment(env), clear=True):
        args = launch_command_parser().parse_args(["--config_file", str(CONFIGS / config), "--num_processes",
                                                   str(processes), "--main_process_port", str(free_port()),
                                                   *launch_args, "script.py"])
        args, _, _ = _validate_launch_command(args)
        assert (args.use_fsdp or args.multi_gpu) and not args.cpu, f"{config}: not multi_gpu_launcher's"
        return launch_utils.prepare_multi_gpu_env(args)


def run_under(launcher: list[str] | Forked, script: Path, *args: str, env: dict | None = None,
              timeout: int = 300) -> None:
    """`script args` under a real launcher command (`env` added to the launcher's environment) or `Forked`."""
    if isinstance(launcher, Forked):
        assert env is None, "a Forked launcher carries its environment: give `env` to forked_*"
        run_script_ranks(script, list(args), launcher.processes, worker_env=launcher.worker_env, cwd=ROOT,
                         timeout=timeout)
    else:
        run_launched([*launcher, str(script), *args], cwd=ROOT, env=env, timeout=timeout)


def launch(config: str, processes: int, out: Path, *script_args: str, launch_args: tuple = (), env=None,
           timeout: int = 300) -> dict:
    """tests/scripts/accel_train.py under a real `accelerate launch --config_file accelerate_configs/<config>`."""
    return _accel_train(accelerate_launch(CONFIGS / config, *launch_args, processes=processes), processes, out,
                        script_args, env, timeout)


def launch_forked(config: str, processes: int, out: Path, *script_args: str, launch_args: tuple = (), env=None,
                  timeout: int = 300) -> dict:
    """`launch`'s run of tests/scripts/accel_train.py with the workers forked from the test harness's fork server
    instead of started by the launcher (tests/dist_harness.run_script_ranks): the same environment and script,
    without ~10 CPU-s of interpreters. For variations of a launch some test runs for real with this config."""
    return _accel_train(forked_accelerate_launch(config, processes, launch_args, env), processes, out, script_args,
                        None, timeout)


def _accel_train(launcher: list[str] | Forked, processes: int, out: Path, script_args: tuple, env, timeout: int
                 ) -> dict:
    run_under(launcher, ACCEL_SCRIPT, "--out", str(out), "--per-device-batch", str(GLOBAL_BATCH // processes),
              *script_args, env=env, timeout=timeout)
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


def run_script(launcher: list[str] | Forked, report: Path, output_dir: Path, processes: int, max_steps: int,
               *extra: str, env: dict | None = None) -> dict:
    """Run the Trainer script under `launcher` with the shared training arguments; its report."""
    run_under(launcher, TRAINER_SCRIPT, "--report", str(report), "--output_dir", str(output_dir),
              "--max_steps", str(max_steps), "--per_device_train_batch_size", str(GLOBAL_BATCH // processes),
              "--learning_rate", "1e-2", "--lr_scheduler_type", "constant", "--logging_steps", "1",
              "--report_to", "none", "--disable_tqdm", "true", *extra, env=env)
    out = json.loads(report.read_text())
    out["losses"] = [out["losses"][str(i)] for i in range(1, max_steps + 1)]
    return out


def train(tmp: Path, name: str, processes: int, max_steps: int, *extra: str, env: dict | None = None,
          real_launch: bool = False) -> dict:
    """torchrun's workers with the Trainer's own flag: `--fsdp full_shard --fsdp_config accelerate_configs/fsdp2.json`,
    forked (`forked_torchrun`) unless `real_launch`."""
    if real_launch:
        launcher, launcher_env = torchrun(processes), env
    else:
        launcher, launcher_env = forked_torchrun(processes, env), None
    return run_script(launcher, tmp / f"{name}.json", tmp / "out", processes, max_steps, "--fsdp", "full_shard",
                      "--fsdp_config", str(ROOT / "accelerate_configs" / "fsdp2.json"), *extra, env=launcher_env)


_SINGLE_TRAINER: dict[int, list[float]] = {}


def single_trainer_losses(tmp: Path, max_steps: int) -> list[float]:
    """The Trainer script's losses on one process (no checkpoints): the reference the launched
    layouts compare with, run once per session for each `max_steps`."""
    if max_steps not in _SINGLE_TRAINER:
        _SINGLE_TRAINER[max_steps] = train(tmp, "single", 1, max_steps, "--save_strategy", "no")["losses"]
    return _SINGLE_TRAINER[max_steps]


def trainer_under_launch(config: str, tmp: Path, max_steps: int = 3) -> dict:
    """The Trainer script as `accelerate launch --config_file accelerate_configs/<config>`'s workers (forked) on 4
    processes of which 2 are data-parallel ranks (x 4 rows = the single process's 8)."""
    return run_script(forked_accelerate_launch(config, 4), tmp / "launched.json", tmp / "launched", 2,
                      max_steps, "--save_strategy", "no")
