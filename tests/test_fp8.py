"""FP8 training with FP8 all-gather (quantization/fp8.py) on 2 real gloo ranks: what is converted,
one all-gather per group moving float8 bytes, losses tracking bf16, ordinary checkpoints."""

from __future__ import annotations

import sys

import pytest
import torch

pytest.importorskip("torchao.float8")

from tests.common import (  # noqa: E402
    FSDP_ALL_GATHER, batches, build_model, count_collectives, full_params, local_rows, lora, optimizer, saved_tensors,
    sharded_train)
from tests.dist_harness import run_ranks  # noqa: E402

STEPS = 6
# intermediate 120: gate/up/down are not multiples of 16 and stay in the training dtype
MODEL = dict(hidden_size=64, intermediate_size=120)


def _gathered_bytes(model, rank, world):
    """Bytes each rank puts into all-gathers during one forward, and the number of all-gathers."""
    ids = local_rows(batches(steps=1)[0], rank, world)
    with count_collectives() as counts, torch.no_grad():
        model(input_ids=ids)
    from hf_fsdp2.checkpoint.tensor_export import reshard

    reshard(model)
    return counts[FSDP_ALL_GATHER], counts["bytes"]


class Block(torch.nn.Module):
    """A layer whose only parameter is one linear weight: its group's all-gather is all float8."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(32, 32, bias=False)

    def forward(self, x):
        return torch.relu(self.proj(x))


class Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(Block() for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _stack_input() -> torch.Tensor:
    return torch.randn(16, 32, generator=torch.Generator().manual_seed(1))


def _probe_loss(model, rank, world) -> float:
    """The loss of one fixed batch, averaged over ranks: what the next step would start from."""
    ids = local_rows(batches(steps=1, seed=7)[0], rank, world)
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.detach().clone()
    torch.distributed.all_reduce(loss)
    return loss.item() / world


def _worker(rank, world, out):
    import hf_fsdp2
    from hf_fsdp2.quantization import fp8

    report = {}
    # gloo cannot all-gather float8 ("Invalid scalar type"): an all-float8 group goes as bytes.
    torch.manual_seed(0)
    stack = hf_fsdp2.shard_model(Stack(), hf_fsdp2.FSDP2Config(layer_cls_names=["Block"], fp8=True))
    report["stack"] = stack(_stack_input()).detach()
    for name, fp8_on in (("bf16", False), ("fp8", True)):
        model = build_model(**MODEL)
        hf_fsdp2.shard_model(model, hf_fsdp2.FSDP2Config(param_dtype="bf16", fp8=fp8_on))
        opt = optimizer(model)
        fp8.attach_to_optimizer(model, opt)
        report[name] = {"gathers": _gathered_bytes(model, rank, world),
                        "losses": sharded_train(model, batches(steps=STEPS), rank, world, opt=opt)}
        if fp8_on:
            report["conversion"] = (fp8.conversion(model).converted, fp8.conversion(model).skipped)
            layer = model.model.layers[0]
            report["types"] = [type(layer.self_attn.q_proj).__name__, type(layer.mlp.up_proj).__name__]
            report["scale_precomputed"] = layer.self_attn.q_proj.weight._local_tensor._precomputed_scale is not None
            hf_fsdp2.save_pretrained(model, f"{out}/model")
            hf_fsdp2.save_state(f"{out}/state", model, opt, step=STEPS)
            report["params"] = full_params(model)
            report["next_loss"] = _probe_loss(model, rank, world)
            resumed = build_model(seed=1, **MODEL)
            hf_fsdp2.shard_model(resumed, hf_fsdp2.FSDP2Config(param_dtype="bf16", fp8=True))
            resumed_opt = optimizer(resumed)
            hf_fsdp2.load_state(f"{out}/state", resumed, resumed_opt)
            report["resumed_loss"] = _probe_loss(resumed, rank, world)  # first: before anything else gathers
            from hf_fsdp2.checkpoint.tensor_export import reshard

            reshard(resumed)
            report["resumed_params"] = full_params(resumed)
    # LoRA: the frozen base layers compute and gather in float8, the adapters stay fp32, one group.
    model = lora(build_model(**MODEL))
    hf_fsdp2.shard_model(model, hf_fsdp2.FSDP2Config(param_dtype="bf16", fp8=True))
    opt = optimizer(model)
    fp8.attach_to_optimizer(model, opt)
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    report["lora_types"] = [type(q_proj.base_layer).__name__, type(q_proj.lora_A["default"]).__name__]
    report["lora_losses"] = sharded_train(model, batches(steps=STEPS), rank, world, opt=opt)
    hf_fsdp2.save_pretrained(model, f"{out}/adapter")
    return report


def test_fp8_all_gather_trains_like_bf16_with_ordinary_checkpoints(tmp_path):
    from transformers import AutoModelForCausalLM

    report = run_ranks(_worker, 2, str(tmp_path))[0]
    from hf_fsdp2.quantization import fp8

    torch.manual_seed(0)
    reference = Stack()
    fp8.convert(reference, list(reference.layers))
    assert torch.equal(report["stack"], reference(_stack_input()).detach())
    converted, skipped = report["conversion"]
    assert len(converted) == 3 * 4 and all(n.split(".")[-1] in ("q_proj", "k_proj", "v_proj", "o_proj")
                                           for n in converted)
    assert skipped["lm_head"] == "outside the decoder layers"
    assert skipped["model.layers.0.mlp.up_proj"] == "dimensions not multiples of 16"
    assert report["types"] == ["Float8Linear", "Linear"]
    assert report["scale_precomputed"]  # by the optimizer hook: one all-reduce for all scales
    # One all-gather per group either way; the converted weights move 1 byte a value instead of 2.
    (bf16_calls, bf16_bytes), (fp8_calls, fp8_bytes) = report["bf16"]["gathers"], report["fp8"]["gathers"]
    assert bf16_calls == fp8_calls == 5  # embedding, 3 layers, [norm, lm_head]
    attention_values = 3 * (64 * 64 + 2 * 32 * 64 + 64 * 64) // 2  # q, k, v, o of 3 layers, per rank
    assert bf16_bytes - fp8_bytes == attention_values  # 2 bytes -> 1 byte for exactly those
    # estimate-memory --fp8 predicts those bytes: each group's all-gather output is S x the input.
    from hf_fsdp2 import FSDP2Config
    from hf_fsdp2.planner.memory import estimate_memory

    for fp8_on, measured in ((False, bf16_bytes), (True, fp8_bytes)):
        estimate = estimate_memory(build_model(**MODEL), 2, FSDP2Config(param_dtype="bf16", fp8=fp8_on), batch_size=None)
        assert sum(g.gathered_bytes for g in estimate.groups) == 2 * measured
    # Losses track the bf16 run (FP8 casts are lossy: close, not equal).
    assert report["fp8"]["losses"] == pytest.approx(report["bf16"]["losses"], rel=0.05)
    assert report["fp8"]["losses"][-1] < report["fp8"]["losses"][0]
    # The checkpoint is the fp32 training weights under the usual names; from_pretrained reads it.
    saved = {k: v.float() for k, v in saved_tensors(tmp_path / "model").items()}
    params = report["params"]
    assert {k: v.dtype for k, v in saved_tensors(tmp_path / "model").items()} == {k: torch.float32 for k in params}
    for name, value in params.items():
        assert torch.equal(saved[name], value), name
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert type(loaded.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    for name, value in report["resumed_params"].items():
        assert torch.equal(value, params[name]), name
    # The resumed model gathers with the saving run's scales: its first loss is the one the saving
    # run would have computed next (before: the scales of the weights load_state replaced).
    assert report["resumed_loss"] == report["next_loss"]
    # LoRA over FP8 base layers.
    assert report["lora_types"] == ["Float8Linear", "Linear"]
    assert report["lora_losses"][-1] < report["lora_losses"][0]
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()


def test_the_conversion_report_is_kept_by_fp8():
    """quantization/fp8.py keeps what it converted (the model's record names no technique): found from the
    PeftModel it converted and from the base inside it, not from another model."""
    from hf_fsdp2.quantization import fp8

    peft_model = lora(build_model(**MODEL))
    base = peft_model.get_base_model()
    report = fp8.convert(peft_model, list(base.model.layers))
    assert fp8.conversion(peft_model) is report and fp8.conversion(base) is report
    assert fp8.conversion(build_model(**MODEL)) is None
    assert any(".lora_A." in name for name in report.skipped) and report.converted


def test_fp8_without_torchao_says_how_to_install(monkeypatch):
    from hf_fsdp2.quantization import fp8

    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(ImportError, match=r"pip install 'torchao>=0.17'"):
        fp8.convert(build_model(**MODEL), [])


def test_fp8_config_field():
    import hf_fsdp2

    assert hf_fsdp2.FSDP2Config(fp8="true").fp8 is True
    with pytest.raises(ValueError, match="`fp8` converts the decoder layers"):
        hf_fsdp2.FSDP2Config(fp8=True, wrap_policy="size")


def test_accelerate_mixed_precision_fp8_with_torchao_is_ours(tmp_path):
    """`accelerate launch --mixed_precision fp8` (torchao backend) on the FSDP2 yaml: the layers'
    linears are converted by hf_fsdp2 (not Accelerate's every-linear-but-first-and-last), the
    prepared optimizer precomputes the scales, losses track fp32's, the model saves as usual."""
    from transformers import AutoModelForCausalLM

    from tests.launched_runs import launch

    from tests.launched_runs import reference_losses

    fp8_run = launch("fsdp2.yaml", 2, tmp_path / "fp8.json", "--steps", "4", "--save-model", str(tmp_path / "model"),
                     launch_args=("--mixed_precision", "fp8"), env={"ACCELERATE_FP8_BACKEND": "AO"})
    assert fp8_run["all_dtensor"] and fp8_run["fp8_linears"] == 3 * 7  # tiny Llama: every layer linear is 16-aligned
    assert fp8_run["fp8_scales_precomputed"]
    # The same script's loop on one process in fp32 (the bf16-vs-fp8 comparison is the 2-rank test's).
    assert fp8_run["losses"] == pytest.approx(reference_losses(4), rel=0.05)
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path / "model").model.layers[0].mlp.up_proj) is torch.nn.Linear
