"""`hf-fsdp2 config` (issue 52): an Accelerate config written for a model from the shipped templates. The shipped
configs are what it writes for the model they name (so the two cannot drift); another model gets its own
decoder layer class; EP and the auto layout's budget are written as the launch's HF_FSDP2_* variables; what hf_fsdp2 would refuse is never written."""

from __future__ import annotations

import pytest

from hf_fsdp2.cli import main
from hf_fsdp2.tools.config_writer import CONFIGS, TEMPLATES, write_config
from hf_fsdp2.tools.check_config import check_accelerate_config

from .common import tiny_config


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama") / "config.json"
    tiny_config().to_json_file(path)
    return path


@pytest.mark.parametrize("template", TEMPLATES)
def test_the_shipped_configs_are_what_it_writes_for_llama(template, llama):
    assert write_config(llama, template=template) == (CONFIGS / f"{template}.yaml").read_text()


def test_another_model_gets_its_own_layer_class_processes_and_precision(tmp_path, capsys):
    from .test_expert_parallel import build_moe

    build_moe().config.save_pretrained(tmp_path / "moe")
    assert main(["config", str(tmp_path / "moe"), "--num-processes", "4", "--mixed-precision", "bf16", "--ep-size",
                 "2", "-o", str(tmp_path / "moe.yaml")]) == 0
    text = (tmp_path / "moe.yaml").read_text()
    assert "fsdp_transformer_layer_cls_to_wrap: Qwen3MoeDecoderLayer" in text and "LlamaDecoderLayer" not in text
    assert "num_processes: 4" in text and "mixed_precision: 'bf16'" in text
    assert text.startswith("# Expert parallelism: launch with HF_FSDP2_EP_SIZE=2")
    assert check_accelerate_config(tmp_path / "moe.yaml", {"HF_FSDP2_EP_SIZE": "2"}) == []
    # the auto layout's budget, which the yaml cannot carry either, for the launch's environment
    budget = write_config(tmp_path / "moe", template="fsdp2_lora", memory_budget="20GiB")
    assert budget.startswith("# the auto layout's memory budget: launch with HF_FSDP2_SHARD_SIZE=auto "
                             "HF_FSDP2_MEMORY_BUDGET=20GiB in the environment")
    (tmp_path / "budget.yaml").write_text(budget)
    assert check_accelerate_config(tmp_path / "budget.yaml", {"HF_FSDP2_SHARD_SIZE": "auto",
                                                              "HF_FSDP2_MEMORY_BUDGET": "20GiB"}) == []
    # a TP template keeps its mesh covering the processes: dp_shard x tp = 8
    tp = write_config(tmp_path / "moe", template="fsdp2_tp", num_processes=8)
    assert "parallelism_config_dp_shard_size: 4" in tp and "num_processes: 8" in tp


@pytest.mark.parametrize("kwargs,message", [
    (dict(ep_size=2), r"`ep_size`=2: LlamaForCausalLM has no experts to split"),
    (dict(ep_size=2, template="fsdp2_tp"), r"`ep_size`=2 with `tp_size`=2 is not done in hf_fsdp2"),
    (dict(template="fsdp2_tp", num_processes=3), r"`num_processes`=3 is not a multiple of the template's"),
    (dict(template="nope"), r"`template`='nope': choose one of fsdp2"),
    (dict(mixed_precision="fp64"), r"`mixed_precision`='fp64'"),
    (dict(memory_budget="lots"), r"`memory_budget`='lots' is not a size"),
])
def test_what_cannot_work_is_refused_by_name(kwargs, message, llama):
    with pytest.raises(ValueError, match=message):
        write_config(llama, **kwargs)


def test_a_config_hf_fsdp2_would_refuse_is_not_written(tmp_path, monkeypatch, capsys):
    from hf_fsdp2.tools import config_writer

    from .test_expert_parallel import build_moe

    build_moe().config.save_pretrained(tmp_path / "moe")
    with pytest.raises(ValueError, match=r"`ep_size`=4 must divide the shard size 2"):
        write_config(tmp_path / "moe", ep_size=4)  # the template's 2 processes
    # whatever check-config finds is an error of the writer's, before any file exists
    monkeypatch.setattr(config_writer, "_set_processes", lambda text, n: text.replace("num_processes: 2", "num_processes: 0"))
    assert main(["config", str(tmp_path / "moe"), "--num-processes", "2", "-o", str(tmp_path / "out.yaml")]) != 0
    assert "hf_fsdp2 would refuse this config: num_processes" in capsys.readouterr().err
    assert not (tmp_path / "out.yaml").exists()
    assert main(["config", str(tmp_path / "missing")]) != 0


def test_the_output_never_replaces_a_file_unasked_nor_reaches_into_the_package(llama, tmp_path, capsys):
    """Issue 65: `-o` replaced an existing file without a word, wrote through a symlink onto its target, and
    `-o accelerate_configs/fsdp2.yaml` in a checkout rewrote the shipped template (so `config-file fsdp2.yaml`
    handed out another model's config)."""
    from pathlib import Path

    out = tmp_path / "mine.yaml"
    out.write_text("keep me\n")
    assert main(["config", str(llama), "-o", str(out)]) == 1
    assert "exists; pass --overwrite to replace it" in capsys.readouterr().err and out.read_text() == "keep me\n"
    assert main(["config", str(llama), "-o", str(out), "--overwrite"]) == 0
    assert out.read_text() == (CONFIGS / "fsdp2.yaml").read_text()
    # a symlink: refused as it stands; with --overwrite the link itself becomes the file, its target untouched
    target, link = tmp_path / "target.yaml", tmp_path / "link.yaml"
    target.write_text("someone else's\n")
    link.symlink_to(target)
    assert main(["config", str(llama), "-o", str(link)]) == 1
    assert "(the link itself: its target is left as it is)" in capsys.readouterr().err
    assert main(["config", str(llama), "-o", str(link), "--overwrite", "--num-processes", "4"]) == 0
    assert target.read_text() == "someone else's\n" and not link.is_symlink() and "num_processes: 4" in link.read_text()
    # the package's own files, by a checkout's accelerate_configs/ link or by name, even with --overwrite
    shipped = {p: p.read_bytes() for p in CONFIGS.iterdir()}
    checkout = Path(__file__).resolve().parents[1] / "accelerate_configs"
    for path in (checkout / "fsdp2.yaml", CONFIGS / "fsdp2_lora.yaml", CONFIGS / "new.yaml", CONFIGS.parent / "x.yaml"):
        assert main(["config", str(llama), "-o", str(path), "--overwrite", "--num-processes", "4"]) == 1, path
        assert "is inside hf_fsdp2's own files" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in CONFIGS.iterdir()} == shipped and not (CONFIGS.parent / "x.yaml").exists()


@pytest.mark.parametrize("command", [["config"], ["estimate-memory", "--world-size", "2", "--model"],
                                     ["plan", "--world-size", "2", "--memory", "1GB", "--model"],
                                     ["simulate", "--world-size", "2", "--model"]])
def test_a_config_json_nested_too_deep_is_one_line_of_error(tmp_path, capsys, command):
    """transformers reads a directory's config.json with plain json: a RecursionError traceback (issue 65), in
    every command that reads a model directory (planner/meta_model.py's load_hf_config, their one reader)."""
    (tmp_path / "config.json").write_text('{"model_type": "llama", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    assert main([*command, str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"hf-fsdp2 {command[0]}: error: ") and "nested more than Python can parse" in err, \
        err[-2000:]
    assert len(err.strip().splitlines()) == 1
