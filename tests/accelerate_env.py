"""What `accelerate launch --config_file FILE` hands the training processes, and what Accelerate and
hf_fsdp2 build from it in this process: shared by the config tests (check-config, published configs)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

from hf_fsdp2 import FSDP2Config


def accelerate_env(path: Path, monkeypatch) -> dict[str, str]:
    """What `accelerate launch --config_file path` would put in the training processes' environment."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import launch as launch_utils

    monkeypatch.setattr(launch_utils, "is_port_in_use", lambda port: False)
    args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    args, _, _ = _validate_launch_command(args)
    env = launch_utils.prepare_multi_gpu_env(args)
    return {k: v for k, v in env.items() if k.startswith(("FSDP_", "PARALLELISM_CONFIG_", "ACCELERATE_"))}


def in_process_env(env: dict[str, str], monkeypatch) -> None:
    for key in list(os.environ):
        if key.startswith(("FSDP_", "PARALLELISM_CONFIG_", "ACCELERATE_", "HF_FSDP2_")):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)


def accelerate_plugin(env: dict[str, str], monkeypatch):
    from accelerate.utils import FullyShardedDataParallelPlugin

    in_process_env(env, monkeypatch)
    return FullyShardedDataParallelPlugin()


def accelerate_fsdp2_config(path: Path, monkeypatch) -> FSDP2Config:
    """The FSDP2Config hf_fsdp2's integration builds in a process launched with this file."""
    from accelerate.parallelism_config import ParallelismConfig

    from hf_fsdp2.integrations.accelerate import config_from_accelerator

    env = accelerate_env(path, monkeypatch)
    plugin = accelerate_plugin(env, monkeypatch)
    pc = ParallelismConfig() if env.get("ACCELERATE_USE_PARALLELISM_CONFIG") == "true" else None
    accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin), parallelism_config=pc,
                                  mixed_precision=env["ACCELERATE_MIXED_PRECISION"])
    return config_from_accelerator(accelerator)
