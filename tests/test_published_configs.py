"""Accelerate configs as PEFT, TRL and Accelerate publish them run unchanged with `register()`
(tests/published_configs/README.md says where each comes from; TRL's are read from the installed trl).

PEFT's and Accelerate's are FSDP1 configs (no `fsdp_version`): hf_fsdp2 runs them as FSDP2 with
Accelerate's own `to-fsdp2` mapping; check-config says so. PEFT's QLoRA config sets
`fsdp_cpu_ram_efficient_loading: true` and `fsdp_offload_params: true`: the 4-bit base is sharded from
rank 0's packed rows, absmax and quantization state, whatever the other ranks loaded.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .accelerate_env import accelerate_env, accelerate_plugin

PUBLISHED = Path(__file__).with_name("published_configs")
PEFT_LORA = PUBLISHED / "peft_sft_fsdp_config.yaml"
PEFT_QLORA = PUBLISHED / "peft_sft_fsdp_config_qlora.yaml"
ACCELERATE_TEMPLATE = PUBLISHED / "accelerate_fsdp_template.yaml"


def trl_config(name: str) -> Path:
    import trl

    return Path(trl.__file__).parent / "accelerate_configs" / name


def all_configs() -> list[Path]:
    return [PEFT_LORA, PEFT_QLORA, ACCELERATE_TEMPLATE, trl_config("fsdp2.yaml")]


@pytest.mark.parametrize("path", all_configs(), ids=lambda p: p.name)
def test_check_config_accepts_each_published_config(path):
    from hf_fsdp2.tools.check_config import check_accelerate_config

    findings = check_accelerate_config(path)
    assert not [f for f in findings if f.level == "error"], findings
    if "fsdp_version" not in path.read_text():
        assert any("runs as FSDP2" in f.message and "accelerate to-fsdp2" in f.message for f in findings), findings


@pytest.mark.parametrize("path, reshard", [(PEFT_LORA, False), (PEFT_QLORA, True), (ACCELERATE_TEMPLATE, True)],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_fsdp1_launch_environment_becomes_fsdp2(path, reshard, monkeypatch):
    """What `accelerate launch` puts in the environment for an FSDP1 file, converted as the backend does
    before Accelerate builds its plugin: Accelerate's own plugin is then FSDP2 with the mapped strategy."""
    from hf_fsdp2.integrations.fsdp1_configs import convert_environment

    env = accelerate_env(path, monkeypatch)
    assert env["FSDP_VERSION"] == "1"
    notes = convert_environment(env)
    assert notes[0] == "fsdp_version: 1 -> 2" and any("fsdp_sharding_strategy" in n for n in notes)
    assert "FSDP_SHARDING_STRATEGY" not in env and "FSDP_BACKWARD_PREFETCH" not in env
    plugin = accelerate_plugin(env, monkeypatch)
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is reshard
    assert plugin.cpu_ram_efficient_loading is True
    from torch.distributed.fsdp import CPUOffloadPolicy

    assert isinstance(plugin.cpu_offload, CPUOffloadPolicy) == ("offload_params: true" in path.read_text())


@pytest.mark.parametrize("strategy", ["HYBRID_SHARD", "NO_SHARD", "5", "FOO", ""])
def test_fsdp1_strategies_without_an_fsdp2_meaning_are_refused_by_name(strategy):
    from hf_fsdp2.integrations.fsdp1_configs import convert_environment

    env = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1", "FSDP_SHARDING_STRATEGY": strategy}
    with pytest.raises(ValueError, match="fsdp_config.fsdp_sharding_strategy"):
        convert_environment(env)


def test_peft_qlora_config_unchanged_shards_rank0s_4bit_weights(tmp_path):
    """PEFT's QLoRA config as published (2 processes, no mixed precision, offload, rank-0 loading):
    every rank but 0 scrambles its loaded weights, packed 4-bit bytes and quantization state; the
    shards hold rank 0's, so losses equal one process's QLoRA and the adapter reloads with PEFT."""
    from peft import PeftModel

    from tests.common import batches, build_model, lora
    from tests.launched_runs import launch, reference_losses
    from tests.test_qlora import stock_4bit

    base = tmp_path / "base"  # as tests/test_qlora.py's bf16_dir: in_features multiples of the blocksize 64
    build_model(hidden_size=128, intermediate_size=192, num_hidden_layers=2).to(torch.bfloat16).save_pretrained(base)
    out = launch(str(PEFT_QLORA), 2, tmp_path / "a.json", "--steps", "3", "--lora", "--from-pretrained", str(base),
                 "--load-in-4bit", "--scramble-other-ranks", "--save-model", str(tmp_path / "adapter"))
    assert out["all_dtensor"] and out["packed_4bit_rows"]
    assert all(local == rows // 2 for local, rows in out["packed_4bit_rows"])  # each rank holds half of them
    quantized = dict(bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_quant_storage=torch.bfloat16)
    model = lora(stock_4bit(base, **quantized))
    assert out["losses"] == pytest.approx(reference_losses(3, model=model), abs=1e-4)
    reloaded = PeftModel.from_pretrained(stock_4bit(base, **quantized), tmp_path / "adapter")
    ids = batches(steps=1, seed=3)[0]
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, model(input_ids=ids).logits, atol=2e-4, rtol=0)


def test_trl_fsdp2_config_unchanged_loads_from_rank0_and_saves_full_state(tmp_path):
    """TRL's accelerate_configs/fsdp2.yaml (read from the installed trl; 8 processes and bf16 overridden
    on the command line for 2 CPU ranks and an fp32 reference): rank-0 loading, FULL_STATE_DICT."""
    from transformers import AutoModelForCausalLM

    from tests.common import build_model
    from tests.launched_runs import launch, reference_losses

    build_model().save_pretrained(tmp_path / "base")
    out = launch(str(trl_config("fsdp2.yaml")), 2, tmp_path / "a.json", "--steps", "3", "--from-pretrained",
                 str(tmp_path / "base"), "--scramble-other-ranks", "--save-model", str(tmp_path / "model"),
                 launch_args=("--mixed_precision", "no"))
    assert out["all_dtensor"]
    reference = build_model()
    assert out["losses"] == pytest.approx(reference_losses(3, model=reference), abs=1e-4)
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "model").state_dict()
    worst = max((reference.state_dict()[k] - v).abs().max().item() for k, v in saved.items())
    assert worst < 1e-4, worst
