"""The suite's forked launches (tests/launched_runs.py: `Forked`) give a script the environment the real
launcher gives it: a script that writes its environment, run both ways, differs only where the launcher's own
process does something the forked workers do without (its agent's store, error file and signal handling)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .dist_harness import accelerate_launch, torchrun
from .launched_runs import CONFIGS, ROOT, forked_accelerate_launch, forked_torchrun, run_under

SCRIPT = ROOT / "tests" / "scripts" / "dump_env.py"
# The per-rank port differs; the real agent hosts the store (USE_AGENT_STORE=True) where forked rank 0 does.
DIFFERENT = {"MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE"}
# Only the agent's: where a worker's error is written for the agent to report, the signals it forwards.
ONLY_REAL = {"TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_SIGNALS_TO_HANDLE"}


def _environments(tmp_path: Path, name: str, launcher, processes: int, env: dict | None = None) -> list[dict]:
    run_under(launcher, SCRIPT, str(tmp_path / name), env=env)
    return [json.loads((tmp_path / f"{name}.{rank}.json").read_text()) for rank in range(processes)]


@pytest.mark.parametrize("launcher", ["accelerate launch", "torchrun"])
def test_forked_workers_get_the_environment_the_launcher_gives(tmp_path, launcher):
    env = {"HF_FSDP2_SHARD_SIZE": "auto"}
    if launcher == "accelerate launch":
        launch_args = ("--fsdp_cpu_ram_efficient_loading", "true", "--dynamo_backend", "inductor")
        real = accelerate_launch(CONFIGS / "fsdp2.yaml", *launch_args, processes=2)
        forked = forked_accelerate_launch("fsdp2.yaml", 2, launch_args, env)
    else:
        real, forked = torchrun(2), forked_torchrun(2, env)
    for got, expected in zip(_environments(tmp_path, "forked", forked, 2),
                             _environments(tmp_path, "real", real, 2, env=env)):
        assert got.keys() - expected.keys() == set()
        assert expected.keys() - got.keys() == ONLY_REAL
        assert {k for k in got if got[k] != expected[k]} == DIFFERENT
        if launcher == "accelerate launch":
            assert expected["FSDP_CPU_RAM_EFFICIENT_LOADING"] == got["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "true"
