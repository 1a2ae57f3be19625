"""TRL's trainers with `hf_fsdp2.register()` as `accelerate launch`'s workers on 2 CPU ranks
(tests/scripts/trl_train.py): the reference model TRL builds is sharded by hf_fsdp2 per layer and
frozen (integrations/trl.py), so is a reward model (Accelerate's prepare_model in evaluation mode), a LoRA policy's adapter-disabled reference needs no second model, and
generation gathers each group once per generate() call (sharding/generation.py; counted in
tests/test_generation.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")

from tests.dist_harness import accelerate_launch, run_launched  # noqa: E402
from tests.launched_runs import forked_accelerate_launch, run_under  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "trl_train.py"


def _tiny_dir(factory, name: str, seed: int, model_class: str = "AutoModelForCausalLM", **config) -> Path:
    """The bundled tiny Llama's config (with `config` overrides), randomly initialised (`seed`), with
    its tokenizer, saved as `model_class`."""
    import transformers

    directory = factory.mktemp(name)
    torch.manual_seed(seed)
    tiny = ROOT / "examples" / "tiny-llama"
    getattr(transformers, model_class).from_config(
        transformers.AutoConfig.from_pretrained(tiny, **config)).save_pretrained(directory)
    transformers.AutoTokenizer.from_pretrained(tiny).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return _tiny_dir(tmp_path_factory, "trl-model", seed=0)


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory):
    """A sequence-classification reward model of the same tiny config (one label)."""
    return _tiny_dir(tmp_path_factory, "trl-reward", seed=1, model_class="AutoModelForSequenceClassification",
                     num_labels=1)


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A teacher for distillation: the same tiny config, other weights."""
    return _tiny_dir(tmp_path_factory, "trl-teacher", seed=2)


def run(tmp_path: Path, processes: int, *script_args: str) -> dict:
    """The script as `accelerate launch --config_file accelerate_configs/fsdp2.yaml`'s workers, forked
    (tests/launched_runs.py; TRL's own command line is launched for real below)."""
    out = tmp_path / f"report-{processes}-{len(list(tmp_path.glob('report-*')))}.json"
    run_under(forked_accelerate_launch("fsdp2.yaml", processes), SCRIPT, "--out", str(out), "--output-dir",
              str(tmp_path / "out"), *script_args)
    return json.loads(out.read_text())


def test_dpo_reference_model_is_sharded_per_layer_and_losses_equal_one_process(model_dir, tmp_path):
    sharded = run(tmp_path, 2, "--trainer", "dpo", "--model", str(model_dir), "--per-device-batch", "2")
    single = run(tmp_path, 1, "--trainer", "dpo", "--model", str(model_dir), "--per-device-batch", "4",
                 "--no-register")
    assert sharded["world"] == 2 and sharded["policy_dtensor"]
    ref = sharded["ref_model"]
    # Per-layer groups (4 layers, embedding, [norm, head], root), every weight a shard, frozen, no grads;
    # TRL's own prepare_fsdp would have made one root group.
    assert ref["groups"] >= 6 and ref["dtensor"] and ref["frozen"] and ref["grads"] == 0
    assert sharded["losses"] == pytest.approx(single["losses"], abs=1e-5)


def test_distillation_teacher_is_sharded_per_layer_and_losses_equal_one_process(model_dir, teacher_dir, tmp_path):
    """TRL's on-policy DistillationTrainer (GKD's successor) prepares its teacher with Accelerate's
    `prepare_model(evaluation_mode=True)`: stock FSDP2 keeps a whole teacher on every rank; hf_fsdp2
    shards it per layer, frozen. The student's completions are greedy (top_k=1), so the losses can be
    compared with one process."""
    args = ("--trainer", "distill", "--model", str(model_dir), "--teacher", str(teacher_dir))
    sharded = run(tmp_path, 2, *args, "--per-device-batch", "2")
    single = run(tmp_path, 1, *args, "--per-device-batch", "4", "--no-register")
    teacher = sharded["teacher_model"]
    assert teacher["groups"] >= 6 and teacher["dtensor"] and teacher["frozen"] and teacher["grads"] == 0
    assert sharded["policy_dtensor"] and single["teacher_model"]["dtensor"] is False
    assert sharded["losses"] == pytest.approx(single["losses"], abs=1e-5) and sharded["losses"][0] > 0


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_grpo_with_a_kl_penalty_shards_its_reference_and_reward_models(model_dir, reward_dir, tmp_path, lora):
    """GRPO with beta > 0; the full run also scores with a reward model, which TRL prepares with
    Accelerate's prepare_model(evaluation_mode=True): stock FSDP2 would keep it whole on every rank."""
    extra = ["--lora"] if lora else ["--reward-model", str(reward_dir)]
    report = run(tmp_path, 2, "--trainer", "grpo", "--model", str(model_dir), *extra)
    assert report["world"] == 2 and report["policy_dtensor"]
    kl = [entry["kl"] for entry in report["logs"]]
    assert kl[0] == 0.0 and kl[1] > 0  # the reference equals the policy until the first step changes it
    if lora:
        assert report["ref_model"] is None  # the adapter-disabled policy is the reference
    else:
        for frozen in (report["ref_model"], *report["reward_models"]):
            assert frozen["groups"] >= 6 and frozen["dtensor"] and frozen["frozen"] and frozen["grads"] == 0
        assert [m["class"] for m in report["reward_models"]] == ["FSDPLlamaForSequenceClassification"]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_grpo_first_step_equals_one_process(model_dir, reward_dir, tmp_path, lora):
    """Greedy completions (top_k=1: the same on 2 ranks as on one process), so GRPO's first step can be
    compared exactly: the policy's entropy over the completions (its log-probs, from the sharded policy,
    LoRA or full), the rewards (the full run's reward model is sharded for inference), the completion
    lengths, the KL to the sharded reference and the loss equal one process's without hf_fsdp2."""
    extra = ["--lora"] if lora else ["--reward-model", str(reward_dir)]
    args = ("--trainer", "grpo", "--model", str(model_dir), "--steps", "1", "--greedy", *extra)
    sharded = run(tmp_path, 2, *args)["logs"][0]
    single = run(tmp_path, 1, *args, "--per-device-batch", "4", "--no-register")["logs"][0]
    keys = ["entropy", "completions/mean_length", "kl", "loss"] + [
        k for k in single if k.startswith("rewards/") and k.endswith("/mean")]
    assert len(keys) == (6 if not lora else 5), single  # the reward model's mean too in the full run
    assert {k: sharded[k] for k in keys} == pytest.approx({k: single[k] for k in keys}, abs=1e-5)
    assert single["entropy"] > 0


def test_grpo_checkpoint_resumes_on_another_rank_count(model_dir, tmp_path):
    """A GRPO run checkpointed on 2 ranks (hf_fsdp2's training state: safetensors model and optimizer,
    RNG, trainer state) resumes on 1: the policy it continues from is the trained one, so its first
    resumed step already differs from the reference (KL > 0; a fresh policy would give exactly 0)."""
    run(tmp_path, 2, "--trainer", "grpo", "--model", str(model_dir), "--steps", "2", "--save-steps", "2")
    checkpoint = tmp_path / "out" / "checkpoint-2"
    assert (checkpoint / "model.safetensors").exists() and (checkpoint / "optimizer.safetensors").exists()
    resumed = run(tmp_path, 1, "--trainer", "grpo", "--model", str(model_dir), "--steps", "3",
                  "--per-device-batch", "4", "--resume", str(checkpoint))
    assert resumed["world"] == 1 and resumed["global_step"] == 3
    step3 = next(entry for entry in resumed["logs"] if entry["step"] == 3)
    assert step3["kl"] > 0


# ---------------------------------------------------------------------------------------------
# vLLM weight sync, at the boundary TRL calls (vLLM itself does not run on this machine)


def _vllm_sync_walk(rank, world, use_lora):
    import trl.generation.vllm_generation as vllm_generation

    import hf_fsdp2
    from hf_fsdp2.integrations import trl as trl_backend

    from .common import build_model, lora

    model = lora(build_model()) if use_lora else build_model()
    hf_fsdp2.shard_model(model)
    from hf_fsdp2.integrations.accelerate import prepare_for_inference

    trl_backend.install_if_imported(prepare_for_inference)  # as register()'s Accelerator does once TRL is imported
    try:
        generation = vllm_generation.VLLMGeneration.__new__(vllm_generation.VLLMGeneration)
        generation.model = model  # what VLLMGeneration.__init__ keeps: the prepared policy
        weights = [(name, tensor.clone()) for name, tensor in generation._iter_named_params()]
    finally:
        trl_backend.uninstall()
    return weights if rank == 0 else None


@pytest.mark.parametrize("use_lora", [False, True], ids=["full", "lora"])
def test_vllm_weight_sync_gets_whole_weights_under_checkpoint_names(use_lora):
    """TRL's `VLLMGeneration._iter_named_params` (what `sync_weights` streams to vLLM) on a model
    hf_fsdp2 sharded: every weight whole, once, under its checkpoint name, LoRA merged."""
    from tests.common import build_model, lora
    from tests.dist_harness import run_ranks

    weights = run_ranks(_vllm_sync_walk, 2, use_lora)[0]
    reference = lora(build_model()).merge_and_unload() if use_lora else build_model()
    expected = reference.state_dict()
    assert sorted(name for name, _ in weights) == sorted(expected)
    assert len(weights) == len(expected)
    for name, tensor in weights:
        torch.testing.assert_close(tensor, expected[name], atol=1e-6, rtol=0)


def test_trl_sft_command_line_is_sharded_under_hf_fsdp2_run(model_dir, tmp_path):
    """TRL's own command line (`trl sft`, which starts `accelerate launch` itself), unedited, under
    `hf-fsdp2 run`: every process registers hf_fsdp2 at start-up; `HF_FSDP2_SHARD_SIZE=auto` makes its planner
    say, on rank 0, that it laid the model out; the saved model loads with transformers."""
    import sys

    import transformers

    from tests.dist_harness import free_port

    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in
                                              ["the capital of france is paris .", "the sky is blue ."] * 4))
    cmd = [sys.executable, "-m", "hf_fsdp2.cli", "run", sys.executable, "-m", "trl.cli.main", "sft",
           "--accelerate_config", str(ROOT / "accelerate_configs" / "fsdp2.yaml"), "--num_processes", "2",
           "--main_process_port", str(free_port()), "--model_name_or_path", str(model_dir), "--dataset_name",
           str(data), "--output_dir", str(tmp_path / "out"), "--max_steps", "2", "--per_device_train_batch_size", "2",
           "--max_length", "32", "--report_to", "none", "--save_strategy", "no", "--bf16", "false"]
    proc = run_launched(cmd, cwd=tmp_path, env={"HF_FSDP2_SHARD_SIZE": "auto"})
    assert proc.stderr.count("hf_fsdp2: registered at start-up") == 2, proc.stderr[-3000:]  # launcher, rank 0
    assert "hf_fsdp2 auto layout on 2 ranks" in proc.stderr, proc.stderr[-3000:]
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
