"""GPU process-group semantics on CPU: the default group refuses CPU tensors as NCCL does
(`dist_harness.NCCL_LIKE`, "cuda:gloo"), the training mesh runs on gloo groups of its own
(`build_mesh`). Every collective hf_fsdp2 issues itself (runtime/collectives.py) is reached here: the
whole checkpoint surface, `from_pretrained` with LoRA and QLoRA, `shard_size="auto"`. Values are
checked against stock transformers/PEFT loading what was written; the same code paths are compared
with one process on plain gloo in the other test files.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.common import build_model, full_params, optimizer, saved_tensors, train_step, trained_one_step
from tests.dist_harness import NCCL_LIKE, run_ranks

LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False)


def _refuses_cpu_tensors() -> bool:
    try:
        dist.all_reduce(torch.ones(1))
    except RuntimeError as error:
        return "device type cpu" in str(error)
    return False


def _checkpoint_surface(rank, world, root):
    import hf_fsdp2
    from hf_fsdp2.runtime import collectives
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaForCausalLM

    root = Path(root)
    out = {"refuses_cpu": _refuses_cpu_tensors(), "default_devices": sorted(collectives.default_group_devices())}
    # Full model: blocking and background saves of weights and state, rotation, resume.
    model, opt = trained_one_step(rank, world)
    out["mesh_backend"] = dist.get_backend(next(model.parameters()).device_mesh.get_group())
    hf_fsdp2.save_pretrained(model, root / "full")
    hf_fsdp2.save_pretrained(model, root / "full-async", blocking=False).wait()
    hf_fsdp2.save_state(root / "states" / "step-1", model, opt, step=1)
    hf_fsdp2.save_state(root / "states" / "step-2", model, opt, step=2, blocking=False, keep_last=1).wait()
    latest = hf_fsdp2.latest_state(root / "states")
    fresh = build_model(seed=7)
    hf_fsdp2.shard_model(fresh)
    fresh_opt = optimizer(fresh)
    step, _ = hf_fsdp2.load_state(latest, fresh, fresh_opt)
    out["resumed"] = (latest.name, step, all(torch.equal(a.to_local(), b.to_local())
                                              for a, b in zip(model.parameters(), fresh.parameters())))
    train_step(fresh, fresh_opt, rank, world, seed=2)  # the restored optimizer state steps
    full = full_params(model)  # collective
    out["full"] = full if rank == 0 else None
    # The planner agrees on a budget across ranks.
    auto = build_model()
    hf_fsdp2.shard_model(auto, hf_fsdp2.FSDP2Config(shard_size="auto"))
    from hf_fsdp2.sharding import model_parts, record_of
    from hf_fsdp2.sharding.replication import is_replicated

    out["auto_mesh"] = list(record_of(auto).mesh.shape)
    # Replicated (shard size 1) with DDP's reducer: its all-reduces run on the mesh's gloo group.
    out["auto_ddp"] = is_replicated(auto)
    auto_opt = optimizer(auto)
    train_step(auto, auto_opt, rank, world, seed=5)
    hf_fsdp2.save_state(root / "auto-state", auto, auto_opt, step=1)
    # LoRA from_pretrained: rank 0's initial adapter broadcast over the mesh; adapter and merged saves.
    torch.manual_seed(100 + rank)  # different on every rank: only the broadcast makes the adapters agree
    peft_model = hf_fsdp2.from_pretrained(LlamaForCausalLM, root / "full", peft_config=LoraConfig(**LORA))
    hf_fsdp2.save_pretrained(peft_model, root / "initial-adapter")
    train_step(peft_model, optimizer(peft_model), rank, world, seed=3)
    hf_fsdp2.save_pretrained(peft_model, root / "adapter")
    hf_fsdp2.save_pretrained(peft_model, root / "merged", merge_adapters=True)
    from hf_fsdp2.checkpoint.full_weights import full_weights  # vLLM weight sync: the merged weights whole

    merged_whole = {name: tensor.clone()
                    for name, tensor in full_weights(model_parts(peft_model), record_of(peft_model).mesh)}
    out["merged_whole"] = merged_whole if rank == 0 else None
    # QLoRA with double quantization: each weight's absmax all-gathered over the mesh.
    qlora = hf_fsdp2.from_pretrained(
        AutoModelForCausalLM, root / "full", torch_dtype=torch.float32, peft_config=LoraConfig(**LORA),
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_use_double_quant=True,
                                               bnb_4bit_compute_dtype=torch.float32))
    train_step(qlora, optimizer(qlora), rank, world, seed=4)
    hf_fsdp2.save_pretrained(qlora, root / "qlora-adapter")
    return out


def test_checkpoint_surface_with_a_default_group_that_refuses_cpu_tensors(tmp_path):
    pytest.importorskip("bitsandbytes")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    outs = run_ranks(_checkpoint_surface, 2, str(tmp_path), backend=NCCL_LIKE)
    for out in outs:
        assert out["refuses_cpu"] and out["default_devices"] == ["cuda"]  # the harness is what it claims
        assert out["mesh_backend"] == "gloo"
        assert out["resumed"] == ("step-2", 2, True)
        assert out["auto_mesh"] == outs[0]["auto_mesh"]
        assert out["auto_mesh"] == [2, 1] and out["auto_ddp"]  # the tiny model fits: replicated
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "full")
    for name, value in loaded.named_parameters():
        torch.testing.assert_close(value, outs[0]["full"][name], atol=0, rtol=0)
    blocking, background = saved_tensors(tmp_path / "full"), saved_tensors(tmp_path / "full-async")
    assert blocking.keys() == background.keys() and all(torch.equal(blocking[k], background[k]) for k in blocking)
    assert sorted(p.name for p in (tmp_path / "states").iterdir()) == ["step-2"]
    # Every rank's rows of the initial adapter are rank 0's initialisation (seed 100, on one process here).
    from peft import LoraConfig
    from transformers import AutoConfig, LlamaForCausalLM

    from hf_fsdp2.checkpoint.pretrained import _with_adapters, parameters_on_meta

    torch.manual_seed(100)
    with parameters_on_meta():
        meta = LlamaForCausalLM(AutoConfig.from_pretrained(tmp_path / "full"))
    expected = {name.replace(".default", ""): p.detach() for name, p in
                _with_adapters(meta, LoraConfig(**LORA), mesh=None).named_parameters() if ".lora_" in name}
    initial = saved_tensors(tmp_path / "initial-adapter", "adapter_model.safetensors")
    assert initial.keys() == expected.keys() and all(torch.equal(initial[k], expected[k]) for k in expected)
    # The trained adapter and the merged model load with stock PEFT / transformers and agree.
    ids = torch.arange(12).view(2, 6)
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "full"), tmp_path / "adapter")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    with torch.no_grad():
        torch.testing.assert_close(peft(input_ids=ids).logits, merged(input_ids=ids).logits, atol=1e-4, rtol=0)
    assert (tmp_path / "qlora-adapter" / "adapter_model.safetensors").is_file()
    merged_file = saved_tensors(tmp_path / "merged")
    assert outs[0]["merged_whole"].keys() == merged_file.keys()
    assert all(torch.equal(outs[0]["merged_whole"][k], merged_file[k]) for k in merged_file)


NCCL_LIKE_SCRIPTS = {"TEST_DEFAULT_BACKEND": NCCL_LIKE}  # tests/nccl_like.py


def test_accelerate_backend_saves_and_resumes_with_a_default_group_that_refuses_cpu_tensors(tmp_path):
    """`accelerate launch` with the default group initialised by the script (Accelerate keeps a group
    it finds): rank-0 loading (`fsdp_cpu_ram_efficient_loading`: rank 0's weights broadcast over the
    mesh), `save_model`, a background `save_state`, then `load_state` in a new launch."""
    from transformers import AutoModelForCausalLM

    from tests.launched_runs import launch_forked, reference_losses

    reference = reference_losses()
    build_model().save_pretrained(tmp_path / "base")
    first = launch_forked("fsdp2.yaml", 2, tmp_path / "a.json", "--steps", "3", "--save-model",
                          str(tmp_path / "model"), "--save-state", str(tmp_path / "state"), "--from-pretrained",
                          str(tmp_path / "base"),
                          launch_args=("--fsdp_cpu_ram_efficient_loading", "true", "--fsdp_sync_module_states", "true"),
                          env={**NCCL_LIKE_SCRIPTS, "HF_FSDP2_ASYNC_SAVE": "1"})
    assert first["all_dtensor"] and first["async_save"] and first["mesh"] == [2]
    assert first["losses"] == pytest.approx(reference[:3], abs=1e-4)
    AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    second = launch_forked("fsdp2.yaml", 2, tmp_path / "b.json", "--steps", "2", "--start", "3",
                           "--load-state", str(tmp_path / "state"), env=NCCL_LIKE_SCRIPTS)
    assert second["losses"] == pytest.approx(reference[3:], abs=1e-4)


def test_trainer_checkpoint_and_resume_with_a_default_group_that_refuses_cpu_tensors(tmp_path):
    """The Trainer (`--fsdp`, torchrun): a checkpoint at step 2, then resumed to step 3 in a new launch."""
    from tests.launched_runs import train

    first = train(tmp_path, "first", 2, 3, "--save_strategy", "steps", "--save_steps", "2", env=NCCL_LIKE_SCRIPTS)
    assert first["all_dtensor"] and first["world"] == 2
    resumed = train(tmp_path, "resumed", 2, 3, "--save_strategy", "no", "--resume",
                    str(tmp_path / "out" / "checkpoint-2"), env=NCCL_LIKE_SCRIPTS)
    assert resumed["losses"][2] == pytest.approx(first["losses"][2], abs=1e-5)
