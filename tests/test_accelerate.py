"""The Accelerate backend under `accelerate launch`, compared with a single-process reference: a real launch
for each shipped yaml's first run (here and in the TP/CP/EP tests), the variations as the launcher's workers
forked with the environment it gives them (tests/launched_runs.launch_forked)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_fsdp2 import FSDP2Config

from .common import build_model
from .dist_harness import accelerate_launch, free_port, run_ranks
from .launched_runs import launch, launch_forked, reference_losses

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "accel_train.py"
CONFIGS = ROOT / "accelerate_configs"
GLOBAL_BATCH = 8
# The deferred load's settings: Accelerate's rank-0 loading flags and the auto layout with an ample budget.
RAM_EFFICIENT = ("--fsdp_cpu_ram_efficient_loading", "true", "--fsdp_sync_module_states", "true")
AUTO_AMPLE = {"HF_FSDP2_SHARD_SIZE": "auto", "HF_FSDP2_MEMORY_BUDGET": "20GB", "HF_FSDP2_PLAN_SEQ_LEN": "16"}


@pytest.mark.oldest
def test_fsdp2_yaml_on_cpu_shards_trains_saves_and_resumes_elsewhere(tmp_path):
    reference = reference_losses()
    # HF_FSDP2_ASYNC_SAVE=1: save_state returns at once; the script then ends (end_training destroys
    # the process group, the interpreter exits), and the state must still be committed whole.
    first = launch("fsdp2.yaml", 2, tmp_path / "a.json", "--steps", "3", "--save-model", str(tmp_path / "model"),
                   "--save-state", str(tmp_path / "state"), env={"HF_FSDP2_ASYNC_SAVE": "1"})
    assert first["distributed_type"] == "DistributedType.FSDP" and first["world"] == 2
    assert first["all_dtensor"] and first["opt_params_are_model_params"] and first["async_save"]
    assert first["losses"] == pytest.approx(reference[:3], abs=1e-4)
    # save_model: a plain Hugging Face directory.
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert loaded.config.num_hidden_layers == 3
    assert not list((tmp_path / "state").glob("*.pkl")) and not list((tmp_path / "state").glob("*.bin"))
    # load_state on one process continues exactly where two left off.
    second = launch("fsdp2.yaml", 1, tmp_path / "b.json", "--steps", "2", "--start", "3",
                    "--load-state", str(tmp_path / "state"))
    assert second["world"] == 1 and second["all_dtensor"]
    assert second["losses"] == pytest.approx(reference[3:], abs=1e-4)


def test_cpu_ram_efficient_loading_broadcasts_rank0_weights(tmp_path):
    """transformers leaves weights the checkpoint lacks on the meta device on every rank but 0, which
    initialises them; the shards must hold rank 0's values, and the loaded weights untouched. The
    layout is the planner's (shard_size="auto"): it plans from shapes, so the ranks holding the model
    on meta make rank 0's plan; a budget only sharding fits makes it shard over both ranks."""
    from safetensors.torch import save_file

    from hf_fsdp2.planner.layout import plan_layout
    from hf_fsdp2.planner.memory import prepare_meta_model

    model = build_model()
    model.save_pretrained(tmp_path / "base")
    state = {k: v for k, v in model.state_dict().items() if k != "model.norm.weight"}  # init: ones, as saved
    save_file(state, tmp_path / "base" / "model.safetensors", metadata={"format": "pt"})
    candidates = plan_layout(prepare_meta_model(model, FSDP2Config()), 2, FSDP2Config(), budget_bytes=1 << 40,
                             device_type="cpu", batch_size=1, seq_len=16).candidates
    budget = int(1.05 * min(c.needed_bytes for c in candidates if c.shard_size == 2))
    assert budget < min(c.needed_bytes for c in candidates if c.shard_size == 1)
    out = launch_forked("fsdp2.yaml", 2, tmp_path / "a.json", "--steps", "3", "--from-pretrained",
                        str(tmp_path / "base"),
                        launch_args=RAM_EFFICIENT,
                        env={"HF_FSDP2_SHARD_SIZE": "auto", "HF_FSDP2_MEMORY_BUDGET": str(budget),
                             "HF_FSDP2_PLAN_SEQ_LEN": "16"})
    assert out["mesh"] == [2]  # one shard group of both ranks (a 1-D mesh)
    assert out["losses"] == pytest.approx(reference_losses(3), abs=1e-4)
    # A key the checkpoint lacks keeps transformers' loading (rank 0's weights broadcast), said on rank 0.
    assert out["loaded_on_meta_everywhere"] is False


def test_cpu_ram_efficient_loading_under_auto_loads_each_ranks_rows_at_prepare(tmp_path):
    """With the auto layout and ram-efficient loading, transformers' from_pretrained builds the model on meta on
    every rank (rank 0 too: no rank reads the whole checkpoint) and prepare reads each rank's rows after
    sharding (integrations/deferred_load.py): the same training as one process."""
    build_model().save_pretrained(tmp_path / "base")
    out = launch_forked("fsdp2.yaml", 2, tmp_path / "a.json", "--steps", "3", "--from-pretrained",
                        str(tmp_path / "base"),
                        launch_args=RAM_EFFICIENT,
                        env=AUTO_AMPLE)
    assert out["loaded_on_meta_everywhere"] is True
    assert out["mesh"] == [2, 1] and out["ddp_reducer"]  # the budget fits replication: DDP's reducer
    assert out["losses"] == pytest.approx(reference_losses(3), abs=1e-4)
    # PEFT's get_peft_model between the load and prepare: the adapters PEFT left on meta are initialised at
    # prepare (PEFT's own init: B = 0, so the first loss is the base model's), the base rows read, and the
    # trained adapter is what PeftModel.from_pretrained loads. Run with a default group that refuses CPU
    # tensors, as NCCL does (tests/nccl_like.py): the adapters' broadcast and the rows' load use the mesh's groups.
    from peft import PeftModel

    from tests.dist_harness import NCCL_LIKE

    lora_out = launch_forked("fsdp2.yaml", 2, tmp_path / "b.json", "--steps", "2", "--from-pretrained",
                             str(tmp_path / "base"), "--lora", "--lora-zero-b", "--save-model",
                             str(tmp_path / "adapter"),
                             launch_args=RAM_EFFICIENT,
                             env={**AUTO_AMPLE, "TEST_DEFAULT_BACKEND": NCCL_LIKE})
    assert lora_out["loaded_on_meta_everywhere"] is True and lora_out["ddp_reducer"]
    assert lora_out["losses"][0] == pytest.approx(reference_losses(1)[0], abs=1e-4)
    assert lora_out["losses"][1] != pytest.approx(lora_out["losses"][0], abs=1e-6)  # the adapters trained
    adapter = PeftModel.from_pretrained(build_model(), tmp_path / "adapter")
    trained_b = [p for n, p in adapter.named_parameters() if "lora_B" in n]
    assert trained_b and all(p.abs().sum() > 0 for p in trained_b)  # B moved from its zero init


def test_a_trained_adapter_loaded_before_prepare_under_deferred_loading_is_kept(tmp_path):
    """Issue 48: with the deferred load (auto layout + ram-efficient loading) the base is on meta until prepare;
    PeftModel.from_pretrained(base, trained_adapter, is_trainable=True) copied the adapter into meta tensors
    (a no-op) and prepare initialised a fresh one. Its values are now kept at the load and restored at prepare:
    the first loss is the trained adapter's, as one process computes it."""
    from peft import PeftModel

    from .common import lora

    build_model().save_pretrained(tmp_path / "base")
    lora(build_model()).save_pretrained(tmp_path / "trained")  # random A and B: it changes the output
    out = launch_forked("fsdp2.yaml", 2, tmp_path / "a.json", "--steps", "2", "--from-pretrained",
                        str(tmp_path / "base"), "--adapter", str(tmp_path / "trained"),
                        launch_args=RAM_EFFICIENT,
                        env=AUTO_AMPLE)
    assert out["loaded_on_meta_everywhere"] is True
    trained = reference_losses(2, model=PeftModel.from_pretrained(build_model(), tmp_path / "trained",
                                                                  is_trainable=True))
    assert trained[0] != pytest.approx(reference_losses(1)[0], abs=1e-3)  # the adapter matters
    assert out["losses"] == pytest.approx(trained, abs=1e-4)


def test_weights_loaded_into_a_deferred_model_before_prepare_are_kept(tmp_path):
    """Issue 65: on the deferred model (meta until prepare) `model.load_state_dict(other_weights)` copied into meta
    tensors (a no-op) and prepare read the directory's weights over it; an adapter's `modules_to_save` copy
    (lm_head) was read from the directory as PEFT's fresh copy. Every value loaded before prepare is now kept and
    written over the directory's rows: the losses are one process's with those weights and that adapter."""
    from peft import PeftModel
    from safetensors.torch import save_file

    from .common import lora

    build_model().save_pretrained(tmp_path / "base")
    save_file(build_model(seed=1).state_dict(), tmp_path / "other.safetensors")
    trained = lora(build_model(), modules_to_save=["lm_head"])
    with torch.no_grad():  # a trained head: it differs from the directory's lm_head
        trained.base_model.model.lm_head.modules_to_save["default"].weight.mul_(1.5)
    trained.save_pretrained(tmp_path / "adapter")
    out = launch_forked("fsdp2.yaml", 2, tmp_path / "a.json", "--steps", "2", "--from-pretrained",
                        str(tmp_path / "base"), "--load-weights", str(tmp_path / "other.safetensors"),
                        "--adapter", str(tmp_path / "adapter"), launch_args=RAM_EFFICIENT, env=AUTO_AMPLE)
    assert out["loaded_on_meta_everywhere"] is True
    expected = reference_losses(2, model=PeftModel.from_pretrained(build_model(seed=1), tmp_path / "adapter",
                                                                   is_trainable=True))
    assert out["losses"] == pytest.approx(expected, abs=1e-4)


def test_an_in_place_change_to_a_deferred_model_before_prepare_is_refused_by_name(tmp_path):
    """Issue 65: an in-place edit of a weight on the meta device (lm_head zeroed) is lost there, and prepare read the
    directory's weights: it trained the base silently. Prepare now refuses it, naming the weight and the way out."""
    build_model().save_pretrained(tmp_path / "base")
    with pytest.raises(AssertionError, match=r"lm_head.weight.*changed in place before accelerator.prepare"):
        launch_forked("fsdp2.yaml", 2, tmp_path / "a.json", "--steps", "1", "--from-pretrained",
                      str(tmp_path / "base"), "--zero-lm-head", launch_args=RAM_EFFICIENT, env=AUTO_AMPLE)


def _changed_before_prepare(rank, world, base, other):
    """Each change to a deferred model before prepare, then prepare's fill (loading.Deferred): the full tensors."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    from hf_fsdp2 import FSDP2Config
    from hf_fsdp2.checkpoint import loading
    from hf_fsdp2.integrations import deferred_load

    head = LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["lm_head"])
    changes = {
        "modules_to_save of a fresh adapter": lambda m: get_peft_model(m, head),
        "weights loaded, then an adapter": lambda m: (m.load_state_dict(load_file(other)), get_peft_model(m, head))[1],
        "weights assigned": lambda m: (m.load_state_dict(load_file(other), assign=True), m)[1],
        "a new Parameter": lambda m: (setattr(m.lm_head, "weight", torch.nn.Parameter(torch.zeros(128, 64))), m)[1],
    }
    out = {}
    for what, change in changes.items():
        model = change(deferred_load.load_on_meta(AutoModelForCausalLM, base, (), {}))
        # as prepare calls them (integrations/accelerate.py)
        fill = loading.Deferred(base, deferred_load.keep_changes(model))
        loading.shard_and_fill(model, loading.plan_for(model, FSDP2Config(), fill), fill)
        deferred_load.filled(model)
        out[what] = {n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
                     for n, t in model.state_dict().items()}
    return out


def test_every_change_given_to_a_deferred_model_before_prepare_is_what_prepare_leaves(tmp_path):
    """Issue 65: what a deferred model (meta until prepare) was given before prepare, by load, assignment or PEFT's
    modules_to_save, is what the prepared model holds, tensor for tensor as one process has it (the LoRA factors
    aside: PEFT initialises them at random). The `original_module` PEFT keeps beside a modules_to_save copy (run
    by `disable_adapter()`) was left uninitialised; it holds the loaded layer now."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file, save_file

    build_model().save_pretrained(tmp_path / "base")
    save_file(build_model(seed=1).state_dict(), tmp_path / "other.safetensors")
    got = run_ranks(_changed_before_prepare, 2, tmp_path / "base", tmp_path / "other.safetensors")[0]
    other = load_file(tmp_path / "other.safetensors")
    head = LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["lm_head"])
    zero_head = build_model()
    zero_head.lm_head.weight = torch.nn.Parameter(torch.zeros(128, 64))
    expected = {
        "modules_to_save of a fresh adapter": get_peft_model(build_model(), head),
        "weights loaded, then an adapter": get_peft_model((lambda m: (m.load_state_dict(other), m)[1])(build_model()),
                                                          head),
        "weights assigned": build_model(seed=1),
        "a new Parameter": zero_head,
    }
    wrong = {}
    for what, model in expected.items():
        want = {n: t for n, t in model.state_dict().items() if ".lora_" not in n}
        assert want.keys() <= got[what].keys(), what
        wrong[what] = [n for n, t in want.items() if not torch.equal(got[what][n], t)]
    assert wrong == dict.fromkeys(expected, [])


def test_an_in_place_change_on_meta_is_refused_at_prepare_and_a_load_is_not(tmp_path):
    """Issue 65: the version counter of each meta tensor, noted when its values were last known (built, or loaded:
    kept), tells an in-place change (lost on meta) from none. `keep_changes` (prepare) refuses the first by name."""
    from transformers import AutoModelForCausalLM

    from hf_fsdp2.integrations import deferred_load

    build_model().save_pretrained(tmp_path)
    for change in (lambda m: m.lm_head.weight.zero_(), lambda m: torch.nn.init.ones_(m.model.norm.weight),
                   lambda m: m.model.layers[1].mlp.up_proj.reset_parameters(),
                   lambda m: (m.load_state_dict(build_model(seed=1).state_dict()), m.lm_head.weight.mul_(2))):
        model = deferred_load.load_on_meta(AutoModelForCausalLM, tmp_path, (), {})
        with torch.no_grad():
            change(model)
        with pytest.raises(RuntimeError, match=r"(lm_head|norm|up_proj)\.weight: changed in place before "
                                               r"accelerator.prepare.*load_state_dict"):
            deferred_load.keep_changes(model)
    model = deferred_load.load_on_meta(AutoModelForCausalLM, tmp_path, (), {})
    model.load_state_dict(build_model(seed=1).state_dict())  # torch's copy counts as a change: kept, not refused
    assert torch.equal(deferred_load.keep_changes(model)["lm_head.weight"], build_model(seed=1).lm_head.weight)


def test_a_deferred_model_used_before_prepare_fails_naming_the_deferral(tmp_path):
    """Issue 48: a model built on meta for prepare and never prepared computed meta logits; its first forward
    now raises, naming deferred loading and the fix."""
    from transformers import AutoModelForCausalLM

    from hf_fsdp2.integrations import deferred_load

    build_model().save_pretrained(tmp_path)
    model = deferred_load.load_on_meta(AutoModelForCausalLM, tmp_path, (), {})
    assert model is not None and all(p.is_meta for p in model.parameters())
    with pytest.raises(RuntimeError, match=r"not loaded yet: hf_fsdp2 deferred loading them to accelerator.prepare"):
        model(input_ids=torch.arange(8).view(1, 8))
    # Resizing reads the embeddings' values: refused by name (it failed on meta tensors or at prepare), through
    # a PeftModel too; once the weights are loaded it is transformers' own again.
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(RuntimeError, match=r"not loaded yet: hf_fsdp2 deferred loading"):
        peft_model(input_ids=torch.arange(8).view(1, 8))  # PEFT calls model.forward itself: the embedding's hook
    for target in (model, peft_model):
        with pytest.raises(RuntimeError, match=r"resize_token_embeddings: its weights are not loaded yet"):
            target.resize_token_embeddings(300)
    with pytest.raises(RuntimeError, match=r"save_pretrained: its weights are not loaded yet.*without weights"):
        model.save_pretrained(tmp_path / "saved")
    assert not (tmp_path / "saved").exists()
    deferred_load.filled(model)  # as prepare leaves it
    model.to_empty(device="cpu")
    assert model.resize_token_embeddings(300).weight.shape[0] == 300


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_deferred_model_has_the_dtypes_transformers_loads(tmp_path, dtype):
    """Issue 48: the deferred meta model cast everything to `dtype`, where transformers keeps RoPE's inv_freq
    (a buffer) and `_keep_in_fp32_modules(_strict)` (DeepseekV3's e_score_correction_bias) in fp32: every
    parameter and buffer now has the dtype stock from_pretrained gives it."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    from hf_fsdp2.integrations import deferred_load

    deepseek = DeepseekV3Config(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                                num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                                q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
    for i, model in enumerate((AutoModelForCausalLM.from_config(deepseek), build_model())):
        model.save_pretrained(tmp_path / str(i))
        stock = AutoModelForCausalLM.from_pretrained(tmp_path / str(i), dtype=dtype)
        ours, why = deferred_load._try_meta(AutoModelForCausalLM, tmp_path / str(i), (), {"dtype": dtype})
        assert ours is not None, why
        expected = {n: t.dtype for n, t in [*stock.named_parameters(), *stock.named_buffers()]}
        assert {n: t.dtype for n, t in [*ours.named_parameters(), *ours.named_buffers()]} == expected
        assert torch.float32 in expected.values()  # something stays fp32: the comparison is not vacuous


def test_gradient_accumulation_and_get_state_dict(tmp_path):
    """`accelerator.accumulate()`: micro-steps communicate nothing, and 2 x 4 rows per process equal
    one step of 8; `get_state_dict` still returns the full state dict. The script rebinds Accelerate's
    `fsdp2_prepare_model` after `register()` as axolotl does: hf_fsdp2 takes it back at prepare."""
    out = launch_forked("fsdp2.yaml", 2, tmp_path / "a.json", "--steps", "3", "--accum", "2",
                        "--per-device-batch", "2", "--foreign-patch")
    assert out["async_save"] is not None  # sharded by hf_fsdp2 although a framework patched Accelerate after us
    assert out["reduce_scatters_in_accumulation_step"] == 0
    assert out["losses"] == pytest.approx(reference_losses(3), abs=1e-4)
    assert out["state_dict_keys"] == len(build_model().state_dict())


def test_auto_layout_and_accelerate_regional_compilation(tmp_path):
    """HF_FSDP2_SHARD_SIZE=auto with an ample budget replicates (2 replicas of 1 rank) with DDP's reducer,
    and Accelerate's own regional compilation (`--dynamo_use_regional_compilation`) and gradient
    accumulation (`set_requires_gradient_sync`) run under it: same losses."""
    out = launch_forked("fsdp2.yaml", 2, tmp_path / "a.json", "--steps", "3", "--accum", "2", "--per-device-batch", "2",
                        launch_args=("--dynamo_backend", "inductor", "--dynamo_use_regional_compilation"),
                        env=AUTO_AMPLE)
    assert out["mesh"] == [2, 1] and out["reshard_after_forward"] is False and out["ddp_reducer"]
    assert out["compiled_modules"] >= 3  # the 3 decoder layers (Accelerate also compiles the other leaves)
    assert out["losses"] == pytest.approx(reference_losses(3), abs=1e-4)


def test_compile_model_under_accelerate_launch(tmp_path):
    """HF_FSDP2_COMPILE=model under `accelerate launch`: the whole forward compiled with its collectives
    (sharding/compile/compiled_collectives.py), here with the gathered weights saved for backward
    (HF_FSDP2_RESHARD_AFTER_FORWARD=false: MUST_SAVE tags) and one bucket (HF_FSDP2_BUCKET_CAP_MB);
    Accelerate's gradient accumulation (`set_requires_gradient_sync`, which reduce-scatters anyway here),
    gradient clipping over DTensor gradients and `save_model` run on it: losses equal one process's, and
    what it saved loads in stock transformers."""
    from transformers import LlamaForCausalLM

    out = launch_forked("fsdp2.yaml", 2, tmp_path / "a.json", "--steps", "2", "--accum", "2", "--per-device-batch", "2",
                        "--save-model", str(tmp_path / "model"),
                        env={"HF_FSDP2_COMPILE": "model", "HF_FSDP2_RESHARD_AFTER_FORWARD": "false",
                             "HF_FSDP2_BUCKET_CAP_MB": "1000"})
    assert out["compiled_collectives"] and out["all_dtensor"] and out["reshard_after_forward"] is False
    assert out["losses"] == pytest.approx(reference_losses(2), abs=1e-4)
    assert out["state_dict_keys"] == len(build_model().state_dict())
    assert LlamaForCausalLM.from_pretrained(tmp_path / "model").num_parameters() == build_model().num_parameters()


def test_without_register_cpu_runs_unsynchronised_replicas(tmp_path):
    """Documents what stock Accelerate does here, which `register()` fixes."""
    out = launch_forked("fsdp2.yaml", 2, tmp_path / "a.json", "--steps", "1", "--no-register")
    # Accelerate < 1.13 starts gloo (MULTI_CPU, DDP) without `cpu=True`; later ones run single-process replicas (NO).
    assert out["distributed_type"] in ("DistributedType.NO", "DistributedType.MULTI_CPU") and not out["all_dtensor"]


def test_lora_yaml_saves_an_adapter_peft_loads(tmp_path):
    from peft import PeftModel

    out = launch("fsdp2_lora.yaml", 2, tmp_path / "a.json", "--steps", "3", "--lora", "--save-model",
                 str(tmp_path / "adapter"))
    assert out["losses"] == pytest.approx(reference_losses(3, use_lora=True), abs=1e-4)
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()
    model = PeftModel.from_pretrained(build_model(), tmp_path / "adapter")
    assert any("lora_A" in n for n, _ in model.named_parameters())


def test_hf_fsdp2_from_pretrained_then_prepare_as_the_yaml_recommends(tmp_path):
    """accelerate_configs/fsdp2.yaml's own advice ("for no full copy per rank, load with hf_fsdp2.from_pretrained"):
    the model arrives at prepare sharded, and is kept as it is (Accelerate's wrap-class lookup, which fails on
    FSDP<Name> classes, is skipped). Full fine-tune and LoRA (peft_config) train as one process does; a setting the
    sharded model cannot take is refused by name with the config to load it with."""
    from peft import PeftModel

    build_model().save_pretrained(tmp_path / "base")
    out = launch_forked("fsdp2.yaml", 2, tmp_path / "a.json", "--steps", "3", "--hf-fsdp2-from-pretrained",
                        str(tmp_path / "base"), "--fsdp2-config", "accelerator", "--save-model",
                        str(tmp_path / "model"))
    assert out["all_dtensor"] and out["opt_params_are_model_params"] and out["mesh"] == [2]
    assert out["losses"] == pytest.approx(reference_losses(3), abs=1e-4)
    lora_out = launch_forked("fsdp2_lora.yaml", 2, tmp_path / "b.json", "--steps", "2", "--hf-fsdp2-from-pretrained",
                             str(tmp_path / "base"), "--lora", "--lora-zero-b", "--save-model",
                             str(tmp_path / "adapter"))
    assert lora_out["losses"][0] == pytest.approx(reference_losses(1)[0], abs=1e-4)  # B = 0: the base's loss
    trained_b = [p for n, p in PeftModel.from_pretrained(build_model(), tmp_path / "adapter").named_parameters()
                 if "lora_B" in n]
    assert trained_b and all(p.abs().sum() > 0 for p in trained_b)


@pytest.mark.parametrize("yaml,args", [("fsdp2_tp.yaml", ("--lora", "--lora-zero-b")), ("fsdp2_cp.yaml", ())])
def test_from_pretrained_on_accelerates_config_and_mesh_under_the_parallel_yamls(yaml, args, tmp_path):
    """The route docs/accelerate.md recommends, under the TP and CP yamls (HSDP's: in the test below):
    hf_fsdp2.from_pretrained(..., accelerator_config(accelerator), mesh=accelerator.torch_device_mesh) then
    prepare (TP loads onto its split from the meta model: the loader fills the weights); losses as one
    process's (TP with a fresh adapter, B = 0: the base's first loss)."""
    build_model().save_pretrained(tmp_path / "base")
    # TP and CP pairs share their batch (2 x 4 = the global 8)
    out = launch_forked(yaml, 4, tmp_path / "a.json", "--steps", "2", "--per-device-batch", "4",
                        "--hf-fsdp2-from-pretrained", str(tmp_path / "base"), "--fsdp2-config", "accelerator", *args)
    assert out["all_dtensor"] and out["mesh"] == [2, 2] and out["world"] == 4
    if args:
        assert out["losses"][0] == pytest.approx(reference_losses(1)[0], abs=1e-4)
    else:
        assert out["losses"] == pytest.approx(reference_losses(2), abs=1e-4)


def test_a_presharded_model_on_a_mesh_without_accelerates_cp_is_refused_by_name():
    """CP runs on Accelerate's mesh ("cp" dimension): a model sharded before prepare on another mesh would run
    every CP rank on whole sequences under torch's ring attention dispatcher, so prepare refuses it by name."""
    from types import SimpleNamespace

    from hf_fsdp2.integrations import presharded
    from hf_fsdp2.sharding.record import record_of

    model = build_model()
    record = record_of(model, create=True)
    record.config = FSDP2Config()
    record.mesh = SimpleNamespace(mesh_dim_names=("dp_shard",))
    with pytest.raises(ValueError, match=r"context parallelism over 2 ranks.*mesh=accelerator.torch_device_mesh"):
        presharded.keep_presharded(model, FSDP2Config(cp_size=2))
    assert presharded.keep_presharded(model, FSDP2Config()) is model
    # a setting that does not change the sharding is taken from Accelerate's (the engine writes the record's config)
    assert presharded.keep_presharded(model, FSDP2Config(async_save=True)) is model and record.config.async_save


def test_a_presharded_model_refuses_settings_it_cannot_take_by_name():
    """What prepare checks for a model sharded before it (integrations/presharded.py): a setting that differs
    is named with the config to load with; unset choices and planner inputs agree with anything; DDP's
    reducer settings count only for a model on the reducer."""
    from hf_fsdp2.integrations import presharded

    have = FSDP2Config(layer_cls_names=["LlamaDecoderLayer"], shard_size=2)
    assert presharded.differing_settings(have, FSDP2Config(shard_size="auto", memory_budget="1GB", async_save=True),
                                         on_reducer=False) == {}
    assert presharded.differing_settings(have, FSDP2Config(find_unused_parameters=True), on_reducer=False) == {}
    assert presharded.differing_settings(have, FSDP2Config(find_unused_parameters=True), on_reducer=True) == {
        "find_unused_parameters": (False, True)}
    assert presharded.differing_settings(have, FSDP2Config(param_dtype="bf16", layer_cls_names=["X"]),
                                         on_reducer=False) == {"param_dtype": (None, torch.bfloat16),
                                                               "layer_cls_names": (("LlamaDecoderLayer",), ("X",))}


def test_hsdp_yaml_as_2x2_on_one_machine_and_as_two_machines(tmp_path):
    """On one machine through the route docs/accelerate.md recommends (hf_fsdp2.from_pretrained on
    accelerator_config(accelerator) and Accelerate's mesh, then prepare), on two with the model built in the
    script: both 2 x 2 (replicas x shards), losses as one process's."""
    reference = reference_losses(3)
    build_model().save_pretrained(tmp_path / "base")
    out = launch_forked("hsdp.yaml", 4, tmp_path / "one.json", "--steps", "3", "--hf-fsdp2-from-pretrained",
                        str(tmp_path / "base"), "--fsdp2-config", "accelerator", launch_args=("--num_machines", "1"))
    assert out["all_dtensor"] and out["mesh"] == [2, 2] and out["world"] == 4
    assert out["losses"] == pytest.approx(reference, abs=1e-4)
    # Two `accelerate launch` invocations, machine ranks 0 and 1, rendezvous on loopback.
    port = free_port()
    procs = []
    for machine in (0, 1):
        cmd = accelerate_launch(CONFIGS / "hsdp.yaml", "--num_machines", "2", "--machine_rank", str(machine),
                                "--main_process_ip", "127.0.0.1", processes=4, port=port) + [
            str(SCRIPT), "--out", str(tmp_path / f"m{machine}.json"), "--per-device-batch", "2", "--steps", "3"]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                                      env={**os.environ, "OMP_NUM_THREADS": "1"}))
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    two = json.loads((tmp_path / "m0.json").read_text())
    assert two["mesh"] == [2, 2] and two["losses"] == pytest.approx(reference, abs=1e-4)


def test_a_model_transformers_sharded_at_load_is_prepared_as_it_is(tmp_path):
    """`from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=2))` (transformers applies FSDP2
    itself) then `accelerator.prepare` with the shipped fsdp2.yaml: hf_fsdp2 keeps transformers' sharding
    (sharding/adopt.py; Accelerate's wrap-class lookup, which the FSDP<Name> classes defeat, is skipped),
    trains equal to one process, and `save_model` writes gather-free files stock transformers loads."""
    from transformers import AutoModelForCausalLM

    build_model().save_pretrained(tmp_path / "model")
    out = launch_forked("fsdp2.yaml", 2, tmp_path / "out.json", "--steps", "3", "--from-pretrained",
                        str(tmp_path / "model"), "--fsdp-size", "2", "--save-model", str(tmp_path / "saved"))
    reference = build_model()
    assert out["all_dtensor"] and out["async_save"] is False  # hf_fsdp2's record: the model is ours
    assert out["losses"] == pytest.approx(reference_losses(3, model=reference), abs=1e-4)
    expected = dict(reference.named_parameters())
    for name, value in AutoModelForCausalLM.from_pretrained(tmp_path / "saved").named_parameters():
        torch.testing.assert_close(value, expected[name], atol=1e-4, rtol=0)


def test_unregister_restores_accelerate():
    import accelerate.accelerator as acc_module
    from accelerate import Accelerator

    import hf_fsdp2

    before = (acc_module.fsdp2_prepare_model, Accelerator.__init__, Accelerator.save_state)
    hf_fsdp2.register()
    hf_fsdp2.register(frozen_dtype="bf16")  # idempotent; replaces overrides
    assert acc_module.fsdp2_prepare_model is not before[0]
    hf_fsdp2.unregister()
    assert (acc_module.fsdp2_prepare_model, Accelerator.__init__, Accelerator.save_state) == before
    with pytest.raises(ValueError, match="`frozen_dtyp`"):
        hf_fsdp2.register(frozen_dtyp="bf16")
    assert acc_module.fsdp2_prepare_model is before[0]


def test_env_overrides_are_validated():
    from hf_fsdp2.integrations.accelerate import env_overrides

    assert env_overrides({"HF_FSDP2_FROZEN_DTYPE": "bf16", "OTHER": "x"}) == {"frozen_dtype": "bf16"}
    with pytest.raises(ValueError, match="HF_FSDP2_\\* environment.*`forward_prefech`"):
        env_overrides({"HF_FSDP2_FORWARD_PREFECH": "1"})


def test_a_mixed_precision_policy_given_to_the_plugin_is_honoured():
    """`FullyShardedDataParallelPlugin(mixed_precision_policy=...)` (Accelerate's Python API; the yaml
    has no key for it) sets hf_fsdp2's param/reduce/output dtypes; one Accelerate fills from
    `mixed_precision` does not (we reduce in fp32 then). Own interpreter: Accelerate's state is global."""
    code = """
import torch, hf_fsdp2
from types import SimpleNamespace
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin
from torch.distributed.fsdp import MixedPrecisionPolicy
from hf_fsdp2.integrations.accelerate import config_from_accelerator
hf_fsdp2.register()
policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, output_dtype=torch.float32)
given = FullyShardedDataParallelPlugin(fsdp_version=2, mixed_precision_policy=policy)
Accelerator(fsdp_plugin=given)
filled = FullyShardedDataParallelPlugin(fsdp_version=2)
filled.set_mixed_precision("bf16")
for plugin in (given, filled):
    c = config_from_accelerator(SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin), mixed_precision="bf16"))
    print(c.param_dtype, c.reduce_dtype, c.output_dtype)
bad = FullyShardedDataParallelPlugin(fsdp_version=2, mixed_precision_policy=MixedPrecisionPolicy(
    param_dtype=torch.bfloat16, cast_forward_inputs=False))
Accelerator(fsdp_plugin=bad)
try:
    config_from_accelerator(SimpleNamespace(state=SimpleNamespace(fsdp_plugin=bad), mixed_precision="bf16"))
except ValueError as e:
    print("refused:", e)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[-3] == "torch.bfloat16 torch.bfloat16 torch.float32", proc.stdout
    assert lines[-2] == "torch.bfloat16 torch.float32 None", proc.stdout
    assert lines[-1].startswith("refused: ") and "cast_forward_inputs=False" in lines[-1], proc.stdout


def test_mixed_precision_upcasts_trainable_weights_to_fp32_masters():
    """Ported from Accelerate's tests/fsdp/test_fsdp.py (FSDP2PluginIntegration:
    test_fsdp2_uniform_dtype_upcast_bf16/_fp16, test_fsdp2_no_dtype_cast_when_no_mixed_precision), where
    fully_shard is mocked; here the model is really prepared (one gloo rank). A bf16 Linear beside an
    fp32 LayerNorm: bf16/fp16 mixed precision keeps fp32 master weights for all, 'no' keeps the dtypes."""
    code = """
import os
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
import torch, hf_fsdp2
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import FullyShardedDataParallelPlugin
from torch.distributed.tensor import DTensor
hf_fsdp2.register()
for precision in ("bf16", "fp16", "no"):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    model[0].to(torch.bfloat16)
    accelerator = Accelerator(mixed_precision=precision, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    model, _ = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    assert all(isinstance(p, DTensor) for p in model.parameters())
    print(precision, sorted({str(p.dtype) for p in model.parameters()}))
    AcceleratorState._reset_state(True)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PORT": str(free_port()), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-3:] == [
        "bf16 ['torch.float32']", "fp16 ['torch.float32']", "no ['torch.bfloat16', 'torch.float32']"], proc.stdout


def test_a_patch_over_ours_is_taken_back_by_name(caplog):
    import accelerate.accelerator

    import hf_fsdp2
    from hf_fsdp2.integrations import accelerate as backend

    def axolotl_like(accelerator, model):
        return model

    hf_fsdp2.register()
    try:
        assert backend.take_back_foreign_patches() == []
        accelerate.accelerator.fsdp2_prepare_model = axolotl_like
        with caplog.at_level("WARNING"):
            taken = backend.take_back_foreign_patches()
        assert len(taken) == 1 and "fsdp2_prepare_model" in taken[0] and "axolotl_like" in taken[0]
        assert accelerate.accelerator.fsdp2_prepare_model is backend._fsdp2_prepare_model
    finally:
        hf_fsdp2.unregister()
    assert accelerate.accelerator.fsdp2_prepare_model is not backend._fsdp2_prepare_model
