"""Transformers Trainer with `--fsdp full_shard --fsdp_config accelerate_configs/fsdp2.json` and
`hf_fsdp2.register()`: torchrun's and `accelerate launch`'s workers on CPU (one real launch of each, the
rest forked with the environment the launcher gives: tests/launched_runs.py), resume across process counts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .common import saved_tensors
from .dist_harness import accelerate_launch
from .launched_runs import forked_accelerate_launch, run_script, train

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "trainer_train.py"
GLOBAL_BATCH = 8


def _eight_bit_flags() -> tuple:
    """`optim="adamw_8bit"` (bitsandbytes) on a model whose matrices get 8-bit state, where it is installed."""
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        return ()
    from .test_bnb_optimizers import SHAPE

    return ("--optim", "adamw_8bit", "--model_shape", json.dumps(SHAPE))


@pytest.mark.parametrize("use_lora, before, after", [(False, 2, 1), (True, 1, 2)])
def test_checkpoint_and_resume_on_another_process_count(tmp_path, use_lora, before, after):
    """Full fine-tune (with bitsandbytes' 8-bit AdamW where it is installed: each rank steps its rows, its
    8-bit state is checkpointed by rows and resumed on one process) on 2 processes resumed on 1, and LoRA
    on 1 resumed on 2."""
    flags = ("--lora", "true") if use_lora else _eight_bit_flags()
    # One uninterrupted run that also checkpoints at step 3 (saving does not change training).
    whole = train(tmp_path, "whole", before, 6, "--save_strategy", "steps", "--save_steps", "3", *flags,
                  real_launch=not use_lora)  # one real torchrun here; the other runs fork its workers
    assert whole["trainable_dtensor"] and (whole["all_dtensor"] or (use_lora and before == 1 and whole["frozen_plain"]))
    if "adamw_8bit" in flags:
        assert whole["optimizer"] == "AdamW" and whole["state_dtypes"] == ["torch.float32", "torch.uint8"]
    ckpt = tmp_path / "out" / "checkpoint-3"
    names = {p.name for p in ckpt.iterdir()}
    weights = "adapter_model.safetensors" if use_lora else "model.safetensors"
    assert {weights, "optimizer.safetensors", "trainer_state.json", "COMPLETE.json"} <= names
    assert not [n for n in names if n.endswith((".pt", ".pth", ".bin", ".pkl"))]
    resumed = train(tmp_path, "resumed", after, 6, "--save_strategy", "no", "--resume", str(ckpt),
                    "--final_dir", str(tmp_path / "final"), *flags)
    assert resumed["world"] == after
    if "adamw_8bit" in flags:
        assert resumed["state_dtypes"] == whole["state_dtypes"]
    assert resumed["losses"][3:] == pytest.approx(whole["losses"][3:], abs=1e-4)
    # save_model under SHARDED_STATE_DICT (where stock Trainer writes no weights) writes a loadable model.
    if use_lora:
        from peft import PeftModel

        from .common import build_model

        PeftModel.from_pretrained(build_model(), tmp_path / "final")
    else:
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained(tmp_path / "final")


def launch_trainer(tmp: Path, name: str, max_steps: int, *extra: str, launch_args: tuple = (),
                   env: dict | None = None, real_launch: bool = False) -> dict:
    """The same Trainer script as `accelerate launch --config_file accelerate_configs/fsdp2.yaml`'s workers (forked
    unless `real_launch`) and no `--fsdp` flag: how libraries built on the Trainer document FSDP."""
    if real_launch:
        launcher = accelerate_launch(ROOT / "accelerate_configs" / "fsdp2.yaml", *launch_args, processes=2)
    else:
        launcher, env = forked_accelerate_launch("fsdp2.yaml", 2, launch_args, env), None
    return run_script(launcher, tmp / f"{name}.json", tmp / name, 2, max_steps, "--save_strategy", "no", *extra,
                      env=env)


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict:
    """The reference: 3 steps on one process (same data order and optimizer: AdamW, lr 1e-2, constant)."""
    return train(tmp_path_factory.mktemp("single"), "single", 1, 3, "--save_strategy", "no")


@pytest.mark.oldest
def test_trainer_script_under_accelerate_launch_is_sharded_on_cpu(tmp_path, single):
    """Issue: on a CPU-only machine this ran two unsynchronised unsharded copies, silently."""
    out = launch_trainer(tmp_path, "launched", 3, real_launch=True)
    assert out["all_dtensor"] and out["world"] == 2
    assert out["losses"] == pytest.approx(single["losses"], abs=1e-4)
    # bf16 on CPU: runs (CPU autocast) instead of stopping at the Trainer's GPU check.
    bf16 = launch_trainer(tmp_path, "bf16", 2, "--bf16", "true")
    assert bf16["all_dtensor"] and bf16["losses"][0] == pytest.approx(out["losses"][0], abs=5e-2)


def test_a_model_hf_fsdp2_from_pretrained_sharded_trains_in_the_trainer(tmp_path, single):
    """The route the shipped configs recommend for no full copy per rank: hf_fsdp2.from_pretrained, then the
    Trainer (its prepare keeps the sharded model: integrations/presharded.py); the same losses as one process
    (LoRA by this route: tests/test_accelerate.py, tests/test_qlora.py)."""
    from .common import build_model

    build_model().save_pretrained(tmp_path / "base")
    out = train(tmp_path, "pre", 2, 3, "--save_strategy", "no", "--hf_fsdp2_from_pretrained", str(tmp_path / "base"))
    assert out["all_dtensor"] and out["world"] == 2
    assert out["losses"] == pytest.approx(single["losses"], abs=1e-4)


@pytest.mark.parametrize("fsdp, edit, extra, reshards, offloads", [
    ("shard_grad_op auto_wrap", {"reshard_after_forward": None},  # the fsdp_config's own value would win
     ("--gradient_accumulation_steps", "2", "--per_device_train_batch_size", "2"),
     False, False),
    ("full_shard auto_wrap offload", {"cpu_ram_efficient_loading": True}, (), True, True),
], ids=["shard_grad_op-accumulation", "offload-ram_efficient_loading"])
def test_trainer_fsdp_options_match_one_process(tmp_path, single, fsdp, edit, extra, reshards, offloads):
    """Transformers' tests/fsdp/test_fsdp.py runs its Trainer with `--fsdp "<strategy> auto_wrap"`
    (full_shard / shard_grad_op), with gradient accumulation (test_basic_run_with_gradient_accumulation),
    with `offload` (test_basic_run_with_cpu_offload) and `cpu_ram_efficient_loading` in its fsdp_config;
    here each also equals the single-process reference."""
    config = {**json.loads((ROOT / "accelerate_configs" / "fsdp2.json").read_text()), **edit}
    config = {key: value for key, value in config.items() if value is not None}
    (tmp_path / "fsdp.json").write_text(json.dumps(config))
    out = train(tmp_path, "run", 2, 3, "--save_strategy", "no", "--fsdp", fsdp, "--fsdp_config",
                str(tmp_path / "fsdp.json"), *extra)
    assert out["all_dtensor"] and out["world"] == 2
    assert (out["reshard_after_forward"], out["offload"]) == (reshards, offloads)
    assert out["losses"] == pytest.approx(single["losses"], abs=1e-4)


def test_evaluation_best_model_and_rotation(tmp_path):
    """Evaluation during training, checkpoints at evaluation steps, `load_best_model_at_end`,
    `save_total_limit` (from Transformers' FSDP tests: eval and checkpointing cases), against the
    same run on one process."""
    import torch

    flags = ("--eval", "true", "--eval_strategy", "steps", "--eval_steps", "2", "--save_strategy", "steps",
             "--save_steps", "2", "--load_best_model_at_end", "true", "--metric_for_best_model", "loss",
             "--greater_is_better", "false", "--save_total_limit", "1")
    two = train(tmp_path / "two", "two", 2, 6, *flags, "--final_dir", str(tmp_path / "final"))
    one = train(tmp_path / "one", "one", 1, 6, *flags)
    assert two["eval_losses"] == pytest.approx(one["eval_losses"], abs=1e-4) and len(two["eval_losses"]) == 3
    best = Path(two["best_model_checkpoint"])
    assert best.name == Path(one["best_model_checkpoint"]).name
    kept = sorted(p.name for p in (tmp_path / "two" / "out").glob("checkpoint-*"))
    assert best.name in kept and len(kept) <= 2  # the best and the latest
    # The same under `accelerate launch --config_file fsdp2.yaml` (no --fsdp flag), with asynchronous
    # checkpoints: rotation after each commit, the best one loaded once its save is done; with the auto
    # layout, which replicates this small model: trained by DDP's reducer (sharding/replication.py).
    launched = launch_trainer(tmp_path, "launched", 6, *flags, env={
        "HF_FSDP2_ASYNC_SAVE": "1", "HF_FSDP2_SHARD_SIZE": "auto", "HF_FSDP2_MEMORY_BUDGET": "20GB"})
    assert launched["async_save"] and launched["ddp_reducer"] and not launched["all_dtensor"]
    assert launched["eval_losses"] == pytest.approx(one["eval_losses"], abs=1e-4)
    assert Path(launched["best_model_checkpoint"]).name == best.name
    assert len(list((tmp_path / "launched").glob("checkpoint-*"))) <= 2
    final, saved = saved_tensors(tmp_path / "final"), saved_tensors(best)
    assert final.keys() == saved.keys() and all(torch.equal(final[k], saved[k]) for k in final)
    # A checkpoint of ours resumed by a Trainer that hf_fsdp2 does not shard: refused, not half-loaded.
    report = tmp_path / "nofsdp.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--report", str(report), "--output_dir", str(tmp_path / "nf"),
                           "--max_steps", "6", "--report_to", "none", "--use_cpu", "true", "--resume", str(best)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode != 0 and "would lose the optimizer, scheduler and RNG state" in proc.stderr, proc.stderr[-3000:]


def test_save_only_model_checkpoints_hold_only_the_model(tmp_path):
    """`save_only_model=True` under `accelerate launch`: weights (equal to one process's) and
    trainer_state.json, no optimizer/RNG; resuming from it is refused with a clear error. (The Trainer
    itself refuses save_only_model with SHARDED_STATE_DICT, hence FULL_STATE_DICT.)"""
    import torch

    config = json.loads((ROOT / "accelerate_configs" / "fsdp2.json").read_text())
    config["state_dict_type"] = "FULL_STATE_DICT"
    (tmp_path / "full.json").write_text(json.dumps(config))
    flags = ("--save_strategy", "steps", "--save_steps", "2", "--save_only_model", "true")
    # transformers 5.6 (fixed by 5.12) does not pass fsdp_config's state_dict_type on to Accelerate's plugin: the
    # plugin's own environment variable says it for every version.
    train(tmp_path / "one", "one", 1, 2, *flags, "--fsdp_config", str(tmp_path / "full.json"),
          env={"FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT"})
    full = ("--fsdp_state_dict_type", "FULL_STATE_DICT")
    launch_trainer(tmp_path, "two", 2, *flags, launch_args=full)
    saved = tmp_path / "two" / "checkpoint-2"
    names = {p.name for p in saved.iterdir()}
    assert {"model.safetensors", "config.json", "trainer_state.json"} <= names
    assert not names & {"optimizer.safetensors", "rng", "hf_fsdp2_state.json"}
    two, one = saved_tensors(saved), saved_tensors(tmp_path / "one" / "out" / "checkpoint-2")
    assert two.keys() == one.keys()
    # Adam's normalised steps (lr 1e-2) turn reduction-order differences of the gradients into ~1e-5.
    assert all(torch.allclose(two[k].float(), one[k].float(), atol=1e-4, rtol=0) for k in one)
    with pytest.raises(AssertionError, match="holds only the model"):
        launch_trainer(tmp_path, "resume", 4, "--resume", str(saved), launch_args=full)
