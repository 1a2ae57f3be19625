"""QLoRA: a bitsandbytes 4-bit base really sharded by FSDP2 (quantization/bnb_4bit.py).

Two launches share the work: 2 ranks on a model loaded by stock transformers (4-bit on every rank,
sharded by `shard_model`), 4 ranks on `hf_fsdp2.from_pretrained(..., quantization_config=...)`
(each rank quantizes its own rows of the bf16 checkpoint). Both are compared with single-process
QLoRA on the same quantized weights, and the 2-rank launch resumes the 4-rank launch's state.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch

pytest.importorskip("bitsandbytes")

import bitsandbytes.functional as F  # noqa: E402
from bitsandbytes.nn import Linear4bit  # noqa: E402
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaForCausalLM  # noqa: E402

from hf_fsdp2.quantization.bnb_4bit import (  # noqa: E402
    dequantize_rows, finish_quantization, prepare_4bit_modules, quant_state, quantize_rows)
from hf_fsdp2.quantization.bnb_4bit import spec_of as bnb_4bit_spec_of  # noqa: E402
from tests.common import (  # noqa: E402
    FSDP_ALL_GATHER, batches, count_collectives, full_params, local_rows, optimizer, plain_params, reference_train, sharded_train,
    tiny_config)
from tests.dist_harness import run_ranks  # noqa: E402

STEPS = 4
TARGETS = ["q_proj", "v_proj", "down_proj"]
LOADED = dict(bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=False, bnb_4bit_quant_storage=torch.bfloat16)
QUANTIZED_BY_RANKS = dict(bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=True, bnb_4bit_quant_storage=torch.float32)


def bnb_config(**kw) -> BitsAndBytesConfig:
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32, **kw)


def stock_4bit(directory, **kw):
    """The model as stock transformers loads it in 4-bit, on one process, computing as the sharded
    model does. bitsandbytes 0.50's `Linear4bit.forward` repacks the weight and takes a bf16 CPU
    kernel in eval mode for inputs without grad when the CPU has avx512_bf16 (its per-module flag
    `support_avx512bf16_for_cpu`); the sharded forward dequantizes and multiplies in the compute
    dtype. With the flag off the reference does the same on every CPU, with the instruction or without."""
    model = AutoModelForCausalLM.from_pretrained(directory, quantization_config=bnb_config(**kw), device_map="cpu",
                                                 dtype=torch.float32)
    pin_4bit_kernels(model)
    return model


def pin_4bit_kernels(model) -> None:
    """Every stock `Linear4bit` of `model` on the generic dequantize-and-matmul path (see `stock_4bit`)."""
    layers = [m for m in model.modules() if isinstance(m, Linear4bit)]
    assert layers and all(hasattr(m, "support_avx512bf16_for_cpu") for m in layers), (
        "bitsandbytes no longer has Linear4bit.support_avx512bf16_for_cpu: find its CPU kernel switch "
        "in bitsandbytes/nn/modules.py and pin it here")
    for module in layers:
        module.support_avx512bf16_for_cpu = False


def lora_config() -> LoraConfig:
    return LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0, init_lora_weights=False)


def dequantized(module) -> torch.Tensor:
    """The dequantized weight of a stock `Linear4bit` or of a sharded one (while its group is gathered)."""
    base = getattr(module, "base_layer", module)
    if bnb_4bit_spec_of(base) is not None:
        return F.dequantize_4bit(base.weight.reshape(-1, 1), quant_state(base))
    return F.dequantize_4bit(base.weight, base.weight.quant_state)


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    """A tiny Llama saved in bf16 by stock save_pretrained (in_features multiples of the blocksize 64)."""
    directory = tmp_path_factory.mktemp("qlora-base")
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_config(hidden_size=128, intermediate_size=192, num_hidden_layers=2)).to(
        torch.bfloat16).save_pretrained(directory)
    return directory


# ---------------------------------------------------------------------------------------------
# One process: the layout and the row-wise quantization are exactly bitsandbytes'


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("storage", [torch.uint8, torch.bfloat16, torch.float16, torch.float32])
def test_row_layout_and_row_quantization_are_bit_exact(quant_type, nested, storage):
    torch.manual_seed(0)
    weight = torch.randn(96, 128, dtype=torch.bfloat16)
    stock = Linear4bit(128, 96, bias=False, compress_statistics=nested, quant_type=quant_type, quant_storage=storage)
    stock.load_state_dict({"weight": weight})
    stock = stock.to("cpu")  # bitsandbytes quantizes here
    expected = dequantized(stock)
    packed_bytes = stock.weight.data.view(torch.uint8).reshape(-1).clone()

    converted = Linear4bit(128, 96, bias=False, compress_statistics=nested, quant_type=quant_type,
                           quant_storage=storage)
    converted.load_state_dict({"weight": weight})
    converted = converted.to("cpu")
    prepare_4bit_modules(converted)
    assert converted.weight.dtype == torch.uint8 and converted.weight.shape == (96, 64)
    assert torch.equal(converted.weight.reshape(-1), packed_bytes)
    assert torch.equal(dequantized(converted), expected)
    x = torch.randn(3, 128)
    torch.testing.assert_close(converted(x), stock(x), rtol=0, atol=0)

    # Quantizing rows alone (a rank's shard) gives the same bytes; so does dequantizing rows alone.
    with torch.device("meta"):
        empty = Linear4bit(128, 96, bias=False, compress_statistics=nested, quant_type=quant_type, quant_storage=storage)
    prepare_4bit_modules(empty, torch.float32)  # stock quantized the fp32 copy of the bf16 weight
    empty.to_empty(device="cpu")
    empty.weight_quant_map = F.get_4bit_type(quant_type, device="cpu")
    if nested:
        empty.weight_nested_quant_map = F.create_dynamic_map()
    absmax = torch.cat([quantize_rows_into(empty, weight, lo, hi) for lo, hi in [(0, 40), (40, 96)]])
    finish_quantization(empty, absmax)
    assert torch.equal(empty.weight.reshape(-1), packed_bytes)
    assert torch.equal(dequantize_rows(empty, empty.weight[40:80], empty.weight_absmax[40:80], 40), expected[40:80])


def test_the_quantized_base_interface_reaches_bitsandbytes():
    """quantization/quantized.py, the one way the rest of hf_fsdp2 reaches a quantized base: a stock
    `Linear4bit` is found before and after `prepare`, its weight's shape, dtype and side data come through the
    interface, and the techniques not done with a quantized base refuse it by name through it."""
    from hf_fsdp2 import FSDP2Config
    from hf_fsdp2.quantization import quantized
    from hf_fsdp2.sharding import model_parts, tensor_parallel

    torch.manual_seed(0)
    weight = torch.randn(96, 128, dtype=torch.bfloat16)
    layer = Linear4bit(128, 96, bias=False, quant_type="nf4")
    layer.load_state_dict({"weight": weight})
    model = torch.nn.ModuleDict({"lin": layer.to("cpu")})
    assert quantized.has_quantized_layers(model) and not quantized.weights(model)
    [(name, module, quantizer)] = quantized.unprepared_layers(model)
    assert name == "lin" and quantizer.source_dtype(name, module) == torch.float32  # Linear4bit's own dtype
    assert quantized.prepare(model) == ["lin"] and quantized.unprepared_layers(model) == []
    [found] = quantized.weights(model).values()
    assert found.packed is model.lin.weight and found.side == (model.lin.weight_absmax,) and found.kind == "nf4"
    assert (found.out_features, found.in_features, found.dtype) == (96, 128, torch.float32)
    assert quantized.is_prepared(model.lin) and torch.equal(found.dequantized_rows(0), dequantized(model.lin))
    # fp32 dequantized, then cast to bf16; Linear4bit's default double quantization decodes the 192 absmax to fp32
    assert found.transient_bytes(torch.bfloat16) == 96 * 128 * (4 + 2) + 4 * (96 * 128 // 64)
    with pytest.raises(NotImplementedError, match=r"`tp_size`=2 with 4-bit \(bitsandbytes\) layers"):
        tensor_parallel.refuse_unsupported(model_parts(model), FSDP2Config(tp_size=2), on_meta=False)
    with pytest.raises(ValueError, match="BitsAndBytesConfig with load_in_4bit=True"):
        quantized.quantize_on_meta(model, object(), torch.bfloat16)


def quantize_rows_into(module, weight, lo, hi):
    """`quantize_rows` for rows [lo, hi) written at their place (as a rank's shard would be)."""
    shard = module.weight
    module.weight = torch.nn.Parameter(shard[lo:hi], requires_grad=False)
    try:
        return quantize_rows(module, weight[lo:hi])
    finally:
        module.weight = shard


def test_bad_inputs_are_named():
    with torch.device("meta"):
        odd = Linear4bit(96, 64, bias=False)  # 96 is not a multiple of the blocksize 64
    with pytest.raises(ValueError, match=r"odd: in_features=96 is not a multiple of the 4-bit blocksize 64"):
        prepare_4bit_modules(torch.nn.ModuleDict({"odd": odd}))
    unquantized = Linear4bit(64, 64, bias=False)  # bitsandbytes quantizes on .to(device), never called
    with pytest.raises(ValueError, match="lin: this Linear4bit holds unquantized weights"):
        prepare_4bit_modules(torch.nn.ModuleDict({"lin": unquantized}))


def test_torch_whose_fully_shard_cannot_hold_uint8_parameters_is_refused_by_name(monkeypatch):
    """torch 2.11's fully_shard makes each sharded parameter require gradients (a uint8 4-bit weight cannot: a
    RuntimeError deep in FSDP2, found on the GPU image): refused by name before any module changes."""
    from hf_fsdp2.runtime import fsdp_state

    with torch.device("meta"):
        layer = Linear4bit(64, 64, bias=False)
    monkeypatch.setattr(fsdp_state, "shards_integer_parameters", lambda: False)
    with pytest.raises(ValueError, match=r"4-bit base weights \(lin, \.\.\.\) sharded by FSDP2 need torch >= 2.13"):
        prepare_4bit_modules(torch.nn.ModuleDict({"lin": layer}))
    assert not hasattr(layer, "weight_absmax")  # nothing converted
    monkeypatch.undo()
    assert fsdp_state.shards_integer_parameters()  # this torch (2.13) can
    prepare_4bit_modules(torch.nn.ModuleDict({"lin": layer}))
    assert hasattr(layer, "weight_absmax")


def test_without_bitsandbytes_the_error_says_how_to_install(monkeypatch):
    from hf_fsdp2.quantization import bnb_4bit

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    with pytest.raises(ImportError, match=r"pip install 'bitsandbytes>=0.50'"):
        bnb_4bit.quantize_on_meta(torch.nn.Linear(2, 2), bnb_config(), torch.float32)


# ---------------------------------------------------------------------------------------------
# 2 ranks: a stock-loaded 4-bit model sharded; 4 ranks: quantized by the ranks while loading


def _stock_loaded_worker(rank, world, directory, resume):
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    import hf_fsdp2

    torch.manual_seed(0)
    model = get_peft_model(stock_4bit(directory, **LOADED), lora_config())
    reference_weights = {n: dequantized(m) for n, m in model.named_modules() if type(m).__name__ == "Linear4bit"
                         and hasattr(m, "quant_state") and not hasattr(m, "base_layer")}
    hf_fsdp2.shard_model(model, hf_fsdp2.FSDP2Config())
    layers = model.base_model.model.model.layers
    q_proj = layers[0].self_attn.q_proj.base_layer
    report = {"local_rows": q_proj.weight.to_local().shape[0], "rows": q_proj.weight.shape[0],
              "dtypes": sorted({str(p.dtype) for p in layers[0].parameters()})}
    # One group per layer holds packed weights, absmax and adapters; gathered, they dequantize bit for bit.
    for layer in layers:
        layer.unshard()
    report["bit_exact"] = all(torch.equal(dequantized(m), reference_weights[n]) for n, m in model.named_modules()
                              if n in reference_weights)
    for layer in layers:
        layer.reshard()
    groups = {id(g): g for m in model.modules() if isinstance(m, FSDPModule)
              if (g := m._get_fsdp_state()._fsdp_param_group) is not None}
    names = {id(p): n for n, p in layers[0].named_parameters()}
    report["layer_group"] = sorted(names[id(p.sharded_param)] for p in
                                   layers[0]._get_fsdp_state()._fsdp_param_group.fsdp_params)
    opt = optimizer(model)  # before the forward below, which leaves the last layer gathered
    ids = local_rows(batches(steps=1)[0], rank, world)
    with count_collectives() as counts, torch.no_grad():
        model(input_ids=ids)
    report["all_gathers"], report["groups"] = counts[FSDP_ALL_GATHER], len(groups)
    hf_fsdp2.load_state(resume, model, opt)  # saved by the 4-rank launch
    ids = local_rows(batches(steps=STEPS + 1)[-1], rank, world)
    loss = model(input_ids=ids, labels=ids).loss
    value = loss.detach().clone()
    dist.all_reduce(value)
    report["resumed_loss"] = value.item() / world
    return report


def _quantized_by_ranks_worker(rank, world, directory, out):
    import hf_fsdp2

    torch.manual_seed(0)  # rank 0's initial adapter, broadcast
    model = hf_fsdp2.from_pretrained(AutoModelForCausalLM, directory, hf_fsdp2.FSDP2Config(), torch_dtype=torch.float32,
                                     quantization_config=bnb_config(**QUANTIZED_BY_RANKS), peft_config=lora_config())
    hf_fsdp2.save_pretrained(model, f"{out}/initial-adapter")
    opt = optimizer(model)
    losses = sharded_train(model, batches(steps=STEPS), rank, world, opt=opt)
    hf_fsdp2.save_state(f"{out}/state", model, opt, step=STEPS)
    hf_fsdp2.save_pretrained(model, f"{out}/adapter")
    hf_fsdp2.save_pretrained(model, f"{out}/merged", merge_adapters=True, dtype=torch.bfloat16)
    from hf_fsdp2.checkpoint.full_weights import full_weights  # TRL's vLLM weight sync reads these
    from hf_fsdp2.sharding import model_parts, record_of

    whole = {name: tensor.clone() for name, tensor in full_weights(model_parts(model), record_of(model).mesh)}
    return {"losses": losses, "adapter": {k: v for k, v in full_params(model).items() if "lora_" in k},
            "full_weights": whole}


def test_qlora_sharded_equals_one_process(bf16_dir, tmp_path):
    data = batches(steps=STEPS)
    # 4 ranks, each quantizing its rows of the bf16 checkpoint while loading.
    ranks4 = run_ranks(_quantized_by_ranks_worker, 4, str(bf16_dir), str(tmp_path))[0]
    reference = PeftModel.from_pretrained(stock_4bit(bf16_dir, **QUANTIZED_BY_RANKS), tmp_path / "initial-adapter",
                                          is_trainable=True)
    reference_losses = reference_train(reference, data)
    torch.testing.assert_close(ranks4["losses"], reference_losses, atol=2e-5, rtol=0)
    expected_adapter = {k: v for k, v in plain_params(reference).items() if "lora_" in k}
    torch.testing.assert_close(ranks4["adapter"], expected_adapter, atol=5e-5, rtol=0)

    # The adapter in PEFT's layout on a fresh 4-bit base gives the reference's outputs.
    ids = batches(steps=1, seed=7)[0]
    reloaded = PeftModel.from_pretrained(stock_4bit(bf16_dir, **QUANTIZED_BY_RANKS), tmp_path / "adapter")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, reference(input_ids=ids).logits, atol=2e-4, rtol=0)

    # Merged: dequantized + delta, a plain bf16 model that stock from_pretrained loads, equal to
    # PEFT's own dequantize + get_delta_weight of the reference to bf16 rounding.
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert "quantization_config" not in merged.config.to_dict()
    assert isinstance(merged.model.layers[0].self_attn.q_proj, torch.nn.Linear) and merged.dtype == torch.bfloat16
    state = merged.state_dict()
    for name, module in reference.named_modules():
        if hasattr(module, "get_delta_weight") and hasattr(module, "base_layer"):
            expected = (dequantized(module).float() + module.get_delta_weight("default").float()).to(torch.bfloat16)
            key = name.removeprefix("base_model.model.") + ".weight"
            torch.testing.assert_close(state[key], expected, atol=1e-2, rtol=1e-2)
    unadapted = "model.layers.0.self_attn.k_proj.weight"  # 4-bit without LoRA: dequantized alone
    k_proj = reference.base_model.model.model.layers[0].self_attn.k_proj
    assert torch.equal(state[unadapted], dequantized(k_proj).to(torch.bfloat16))
    # The same weights whole, one at a time (vLLM weight sync): the merged file's names, in float32.
    whole = ranks4["full_weights"]
    assert sorted(whole) == sorted(state) and all(t.dtype == torch.float32 for t in whole.values())
    torch.testing.assert_close({k: v.to(torch.bfloat16) for k, v in whole.items()}, state, atol=0, rtol=0)

    # 2 ranks on a stock-loaded 4-bit model: sharded for real, one all-gather per group, bit-exact
    # weights; it resumes the 4-rank state (elastic) and continues like the reference.
    report = run_ranks(_stock_loaded_worker, 2, str(bf16_dir), str(tmp_path / "state"))[0]
    assert report["bit_exact"]
    assert (report["local_rows"], report["rows"]) == (64, 128)
    assert report["dtypes"] == ["torch.float32", "torch.uint8"]  # packed, absmax | LoRA, norms
    assert report["all_gathers"] == report["groups"] == 4  # 2 layers, embedding, [norm, lm_head]: one each
    adapted = [f"{m}.{p}" for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")
               for p in ("base_layer.weight", "base_layer.weight_absmax", "lora_A.default.weight", "lora_B.default.weight")]
    plain = [f"{m}.{p}" for m in ("self_attn.k_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj")
             for p in ("weight", "weight_absmax")]
    assert report["layer_group"] == sorted(adapted + plain + ["input_layernorm.weight", "post_attention_layernorm.weight"])
    ids = batches(steps=STEPS + 1)[-1]
    resumed_reference = PeftModel.from_pretrained(stock_4bit(bf16_dir, **LOADED), tmp_path / "adapter")
    with torch.no_grad():
        expected_loss = resumed_reference(input_ids=ids, labels=ids).loss.item()
    assert abs(report["resumed_loss"] - expected_loss) < 1e-4


# ---------------------------------------------------------------------------------------------
# Accelerate: the QLoRA yaml under a real `accelerate launch`


def test_accelerate_qlora_yaml_shards_the_4bit_base(bf16_dir, tmp_path):
    from tests.common import lora
    from tests.launched_runs import launch, reference_losses

    # mixed_precision overridden to 'no' (the yaml says bf16) so losses compare with an fp32 reference.
    out = launch("fsdp2_qlora.yaml", 2, tmp_path / "a.json", "--steps", "3", "--lora", "--from-pretrained",
                 str(bf16_dir), "--load-in-4bit", "--save-model", str(tmp_path / "adapter"),
                 launch_args=("--mixed_precision", "no"))
    assert out["all_dtensor"] and out["packed_4bit_rows"]
    assert all(local == rows // 2 for local, rows in out["packed_4bit_rows"])  # each rank holds half of them
    quantized = dict(bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_quant_storage=torch.bfloat16)
    model = lora(stock_4bit(bf16_dir, **quantized))
    losses = reference_losses(3, model=model)  # tests/scripts/accel_train.py's loop on one process
    assert out["losses"] == pytest.approx(losses, abs=1e-4)
    reloaded = PeftModel.from_pretrained(stock_4bit(bf16_dir, **quantized), tmp_path / "adapter")
    ids = batches(steps=1, seed=3)[0]
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, model(input_ids=ids).logits, atol=2e-4, rtol=0)


def test_qlora_yaml_with_hf_fsdp2_from_pretrained_as_it_recommends(bf16_dir, tmp_path):
    """fsdp2_qlora.yaml, as shipped (bf16 compute, activation checkpointing), with the loading its comment
    recommends: hf_fsdp2.from_pretrained(..., hf_fsdp2.accelerator_config(accelerator), quantization_config=...,
    peft_config=...), then prepare keeps the sharded model. The 4-bit rows are each rank's, the adapters train,
    and PEFT loads what save_model wrote."""
    from tests.launched_runs import launch

    out = launch("fsdp2_qlora.yaml", 2, tmp_path / "a.json", "--steps", "3", "--lora", "--lora-zero-b",
                 "--hf-fsdp2-from-pretrained", str(bf16_dir), "--load-in-4bit", "--save-model",
                 str(tmp_path / "adapter"), "--fsdp2-config", "accelerator")
    assert out["all_dtensor"] and out["packed_4bit_rows"]
    assert all(local == rows // 2 for local, rows in out["packed_4bit_rows"])
    assert all(math.isfinite(x) for x in out["losses"]) and out["losses"][-1] != out["losses"][0]
    reloaded = PeftModel.from_pretrained(stock_4bit(bf16_dir, bnb_4bit_quant_type="nf4"), tmp_path / "adapter")
    trained_b = [p for n, p in reloaded.named_parameters() if "lora_B" in n]
    assert trained_b and all(p.abs().sum() > 0 for p in trained_b)


# ---------------------------------------------------------------------------------------------
# Transformers Trainer: the flag (--fsdp full_shard --fsdp_config ...) with a 4-bit PEFT model


def test_trainer_flag_trains_qlora_with_a_sharded_4bit_base(bf16_dir, tmp_path):
    """The Trainer's own flag shards the 4-bit base and checkpoints adapter + optimizer. (Equality
    with one process is the Accelerate test's, the same engine; elastic resume of a QLoRA state is
    the 4-rank/2-rank test's; the Trainer's resume path is tests/test_trainer.py's.)"""
    from tests.launched_runs import train

    flags = ("--lora", "true", "--load_in_4bit", str(bf16_dir))
    sharded = train(tmp_path, "sharded", 2, 3, "--save_strategy", "steps", "--save_steps", "3", *flags)
    assert sharded["all_dtensor"] and sharded["world"] == 2
    assert sharded["packed_4bit_rows"] and all(local == rows // 2 for local, rows in sharded["packed_4bit_rows"])
    assert all(math.isfinite(loss) for loss in sharded["losses"])
    checkpoint = tmp_path / "out" / "checkpoint-3"
    assert (checkpoint / "adapter_model.safetensors").exists() and (checkpoint / "optimizer.safetensors").exists()


def test_load_in_8bit_base_is_refused_by_name(tmp_path):
    """An 8-bit base (`load_in_8bit`) keeps row statistics outside its int8 tensor that FSDP2 would
    drop: shard_model refuses it, naming the layers and the 4-bit alternative."""
    from hf_fsdp2.quantization.bnb_4bit import refuse_8bit_modules
    from tests.common import build_model

    build_model().save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=BitsAndBytesConfig(load_in_8bit=True),
                                                 device_map="cpu")
    with pytest.raises(ValueError, match=r"load_in_8bit.*q_proj.*load_in_4bit=True"):
        refuse_8bit_modules(model)
