"""`hf-fsdp2 check-config`: the bundled configs pass, every class of problem is found, and every claim the
checker makes about Accelerate holds for the installed Accelerate (its parser, launcher and plugins are run
in-process on the files; nothing is launched)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import yaml

from hf_fsdp2 import FSDP2Config
from hf_fsdp2.tools.check_config import (
    FSDP_KEYS,
    PARALLELISM_KEYS,
    TOP_LEVEL_KEYS,
    ConfigFileError,
    Finding,
    check_accelerate_config,
    check_accelerate_config_dict,
    fsdp2_values,
)
from hf_fsdp2.cli import main

from .accelerate_env import accelerate_env, accelerate_fsdp2_config, accelerate_plugin, in_process_env

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "accelerate_configs").glob("*.yaml"))
FSDP2_YAML = ROOT / "accelerate_configs" / "fsdp2.yaml"
HSDP_YAML = ROOT / "accelerate_configs" / "hsdp.yaml"


def base(path: Path = FSDP2_YAML) -> dict:
    return yaml.safe_load(path.read_text())


def write(tmp_path: Path, cfg: dict, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def found(findings: list[Finding]) -> set[tuple[str, str]]:
    return {(f.level, f.key) for f in findings}


# ---------------------------------------------------------------------------------------------
# Running Accelerate's own path on a file, in-process


@pytest.mark.parametrize("fields, message", [
    ({"sp_size": 2}, "parallelism_config sp_size=2: sequence parallelism"),
    ({"cp_size": 2, "cp_backend": "deepspeed"}, "cp_backend='deepspeed'"),
])
def test_model_parallel_settings_we_cannot_honour_are_refused_where_the_model_is_prepared(fields, message):
    """Never a silent data-parallel run: sp > 1 (DeepSpeed's Ulysses) and a CP backend other than torch's
    are refused by name at the backend's config step."""
    from hf_fsdp2.integrations.accelerate import config_from_accelerator

    pc = SimpleNamespace(dp_shard_size=2, dp_replicate_size=1, tp_size=1, sp_size=1, cp_size=1, cp_backend="torch")
    pc.__dict__.update(fields)
    accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=SimpleNamespace(
        param_init_fn=None, limit_all_gathers=True)), parallelism_config=pc, mixed_precision="no")
    with pytest.raises(ValueError, match=message):
        config_from_accelerator(accelerator)


def validate_parallelism(env: dict[str, str], processes: int, monkeypatch) -> None:
    """`ParallelismConfig._validate_accelerator` for an FSDP2 accelerator with `processes` ranks."""
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DistributedType

    in_process_env(env, monkeypatch)
    accelerator = SimpleNamespace(multi_device=True, num_processes=processes, is_fsdp2=True,
                                  distributed_type=DistributedType.FSDP)
    ParallelismConfig()._validate_accelerator(accelerator)


# ---------------------------------------------------------------------------------------------
# The key tables are Accelerate's


def test_key_tables_match_the_installed_accelerate():
    import inspect

    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.commands.launch import launch_command_parser
    from accelerate.utils import launch as launch_utils

    dests = {a.dest for a in launch_command_parser()._actions}
    # fsdp_ignored_modules has no flag, but the launcher reads it when the yaml sets it.
    assert FSDP_KEYS == {d for d in dests if d.startswith("fsdp_")} | {"fsdp_ignored_modules"}
    env_source = inspect.getsource(launch_utils.prepare_multi_gpu_env)
    assert all(f"args.{key}" in env_source or f'"{key}"' in env_source for key in FSDP_KEYS)
    assert PARALLELISM_KEYS == {d for d in dests if d.startswith("parallelism_config_")}
    assert TOP_LEVEL_KEYS == set(ClusterConfig.__dataclass_fields__) | {"fp16", "dynamo_backend"}


# ---------------------------------------------------------------------------------------------
# The bundled configs


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_bundled_config_is_clean(path):
    assert check_accelerate_config(path) == []
    assert main(["check-config", str(path)]) == 0


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_bundled_config_parses_with_accelerate_as_the_checker_predicts(path, monkeypatch):
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file

    loaded = load_config_from_file(str(path))
    assert isinstance(loaded, ClusterConfig) and loaded.distributed_type == "FSDP"
    env = accelerate_env(path, monkeypatch)
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["FSDP_VERSION"] == "2"
    assert env["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "false"
    assert accelerate_fsdp2_config(path, monkeypatch) == FSDP2Config.from_dict(fsdp2_values(base(path)))


@pytest.mark.parametrize("edit", [
    {"fsdp_transformer_layer_cls_to_wrap": ["LlamaDecoderLayer", "MistralDecoderLayer"]},
    {"fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer, MistralDecoderLayer"},
    {"fsdp_transformer_layer_cls_to_wrap": None},
    {"fsdp_reshard_after_forward": "False", "fsdp_offload_params": "yes"},
    {"fsdp_auto_wrap_policy": "NO_WRAP"},
    {"fsdp_auto_wrap_policy": "SIZE_BASED_WRAP", "fsdp_min_num_params": 20000},
    {"fsdp_ignored_modules": "lm_head"},
    {"fsdp_cpu_ram_efficient_loading": True, "fsdp_sync_module_states": True},  # works: rank 0's weights broadcast
    {"reshard_after_forward": False, "offload_params": True},  # Accelerate adds the fsdp_ prefix itself
    {"mixed_precision": "bf16"},
    {"mixed_precision": "FP16"},
], ids=str)
def test_predicted_fsdp2_config_is_what_the_integration_builds(edit, tmp_path, monkeypatch):
    cfg = base()
    for key, value in edit.items():
        (cfg if key == "mixed_precision" else cfg["fsdp_config"])[key] = value
    path = write(tmp_path, cfg)
    assert [f for f in check_accelerate_config(path) if f.level == "error"] == []
    assert accelerate_fsdp2_config(path, monkeypatch) == FSDP2Config.from_dict(fsdp2_values(cfg))


def test_hsdp_on_one_machine_is_predicted_too(tmp_path, monkeypatch):
    cfg = base(HSDP_YAML)
    cfg.update(num_machines=1)
    cfg.pop("main_process_ip")
    path = write(tmp_path, cfg)
    assert check_accelerate_config(path) == []
    config = accelerate_fsdp2_config(path, monkeypatch)
    assert (config.replicate_size, config.shard_size) == (2, 2)
    assert config == FSDP2Config.from_dict(fsdp2_values(cfg))


# ---------------------------------------------------------------------------------------------
# Each class of problem, and what Accelerate really does with it


def fsdp(**entries):
    def edit(cfg):
        cfg["fsdp_config"].update(entries)
    return edit


def top(**entries):
    def edit(cfg):
        cfg.update(entries)
    return edit


def drop(key):
    def edit(cfg):
        (cfg["fsdp_config"] if key.startswith("fsdp_") else cfg).pop(key)
    return edit


def parallel(processes=4, machines=1, **sizes):
    def edit(cfg):
        cfg.update(num_processes=processes, num_machines=machines)
        if machines > 1:
            cfg["main_process_ip"] = "127.0.0.1"
        cfg["parallelism_config"] = dict(sizes)
    return edit


CASES = {
    # keys Accelerate drops
    "typo in fsdp_config": (fsdp(fsdp_trasformer_layer_cls_to_wrap="X"), "error",
                            "fsdp_config.fsdp_trasformer_layer_cls_to_wrap", "fsdp_transformer_layer_cls_to_wrap"),
    "hf_fsdp2 field in fsdp_config": (fsdp(fsdp_frozen_dtype="bf16"),
                                      "error", "fsdp_config.fsdp_frozen_dtype", "HF_FSDP2_FROZEN_DTYPE"),
    "unknown top-level key": (top(mixed_precison="bf16"), "error", "mixed_precison", "mixed_precision"),
    "fsdp key at top level": (top(fsdp_version=2), "error", "fsdp_version", "inside `fsdp_config`"),
    "unprefixed parallelism key": (parallel(dp_shard_size=4),
                                   "error", "parallelism_config.dp_shard_size", "parallelism_config_dp_shard_size"),
    # keys Accelerate mangles
    "layer list": (fsdp(fsdp_transformer_layer_cls_to_wrap=["LlamaDecoderLayer"]),
                   "warning", "fsdp_config.fsdp_transformer_layer_cls_to_wrap", "repairs"),
    "unquoted no": (top(mixed_precision=False), "error", "mixed_precision", "quote it"),
    "not a boolean": (fsdp(fsdp_offload_params="enabled"), "error", "fsdp_config.fsdp_offload_params", "true or false"),
    "empty boolean": (fsdp(fsdp_activation_checkpointing=None),
                      "error", "fsdp_config.fsdp_activation_checkpointing", "not a boolean"),
    "quoted false for ram-efficient loading": (fsdp(fsdp_cpu_ram_efficient_loading="false",
                                                    fsdp_sync_module_states=False),
                                               "error", "fsdp_config.fsdp_cpu_ram_efficient_loading", "quoted"),
    "layer names without the transformer policy": (drop("fsdp_auto_wrap_policy"),
                                                   "warning", "fsdp_config.fsdp_transformer_layer_cls_to_wrap",
                                                   "one fully_shard group for the whole model"),
    # settings hf_fsdp2 cannot honour
    "not FSDP": (top(distributed_type="MULTI_GPU"), "error", "distributed_type", "FSDP"),
    "no distributed_type": (drop("distributed_type"), "error", "distributed_type", "missing"),
    "FSDP1": (fsdp(fsdp_version=1), "warning", "fsdp_config.fsdp_version", "runs as FSDP2"),
    "no fsdp_version": (drop("fsdp_version"), "warning", "fsdp_config.fsdp_version", "FSDP1"),
    "FSDP1 hybrid strategy": (lambda c: (fsdp(fsdp_version=1)(c), fsdp(fsdp_sharding_strategy="HYBRID_SHARD")(c)),
                              "error", "fsdp_config.fsdp_sharding_strategy", "parallelism_config"),
    "FSDP3": (fsdp(fsdp_version=3), "error", "fsdp_config.fsdp_version", "2"),
    "use_cpu": (top(use_cpu=True), "error", "use_cpu", "gloo"),
    "fp8 with Transformer Engine": (lambda c: (top(mixed_precision="fp8")(c), c.update(fp8_config={"backend": "TE"}))
                                    , "error", "fp8_config.backend", "torchao"),
    "bad precision": (top(mixed_precision="int8"), "error", "mixed_precision", "precision"),
    "reshard to a group size": (fsdp(fsdp_reshard_after_forward=2),
                                "error", "fsdp_config.fsdp_reshard_after_forward", "register(reshard_after_forward=2)"),
    "FSDP1 strategy as reshard": (fsdp(fsdp_reshard_after_forward="SHARD_GRAD_OP"),
                                  "error", "fsdp_config.fsdp_reshard_after_forward", "SHARD_GRAD_OP -> false"),
    "checkpointing without a wrap policy": (lambda cfg: (drop("fsdp_auto_wrap_policy")(cfg),
                                                         fsdp(fsdp_activation_checkpointing=True)(cfg)),
                                            "error", "fsdp_config.fsdp_activation_checkpointing", "crashes"),
    "checkpoint offload without checkpointing": (fsdp(fsdp_activation_checkpointing_offload=True),
                                                 "error", "fsdp_config.fsdp_activation_checkpointing_offload",
                                                 "fsdp_activation_checkpointing: true"),
    "LOCAL_STATE_DICT": (fsdp(fsdp_state_dict_type="LOCAL_STATE_DICT"),
                         "error", "fsdp_config.fsdp_state_dict_type", "LOCAL_STATE_DICT"),
    "bad backward prefetch": (fsdp(fsdp_backward_prefetch="EARLY"), "error", "fsdp_config.fsdp_backward_prefetch",
                              "BACKWARD_PRE"),
    "ignored_modules not a regex": (fsdp(fsdp_ignored_modules="lm_head("), "error", "fsdp_config.fsdp_ignored_modules",
                                    "regular expression"),
    "bad wrap policy": (fsdp(fsdp_auto_wrap_policy="LAYER_WRAP"), "error", "fsdp_config.fsdp_auto_wrap_policy",
                        "TRANSFORMER_BASED_WRAP"),
    "sharding strategy": (fsdp(fsdp_sharding_strategy="HYBRID_SHARD"), "warning", "fsdp_config.fsdp_sharding_strategy",
                          "parallelism_config"),
    "backward prefetch": (fsdp(fsdp_backward_prefetch="BACKWARD_POST"), "warning",
                          "fsdp_config.fsdp_backward_prefetch", "HF_FSDP2_BACKWARD_PREFETCH"),
    "forward prefetch": (fsdp(fsdp_forward_prefetch=True), "warning", "fsdp_config.fsdp_forward_prefetch",
                         "HF_FSDP2_FORWARD_PREFETCH"),
    "uneven processes": (top(num_processes=3, num_machines=2, main_process_ip="10.0.0.1"),
                         "error", "num_processes", "evenly"),
    "no num_processes": (drop("num_processes"), "warning", "num_processes", "--num_processes"),
    "no main_process_ip": (top(num_processes=4, num_machines=2), "warning", "main_process_ip", "--main_process_ip"),
    "sizes do not multiply to num_processes": (parallel(parallelism_config_dp_replicate_size=2,
                                                        parallelism_config_dp_shard_size=3),
                                               "error", "parallelism_config", "2 x 3 x 1 x 1 x 1 = 6"),
    "sequence parallel": (parallel(parallelism_config_dp_shard_size=2, parallelism_config_sp_size=2),
                          "error", "parallelism_config.parallelism_config_sp_size", "not supported"),
    "context parallel on another backend": (parallel(parallelism_config_dp_shard_size=2,
                                                     parallelism_config_cp_size=2,
                                                     parallelism_config_cp_backend="deepspeed"),
                                            "error", "parallelism_config.parallelism_config_cp_backend", "torch"),
    "nothing to shard over": (parallel(parallelism_config_dp_replicate_size=4),
                              "error", "parallelism_config.parallelism_config_dp_shard_size", "dp_shard"),
    "all sizes 1": (parallel(parallelism_config_dp_replicate_size=1), "error", "parallelism_config", "every size is 1"),
    "replicas across machines": (parallel(processes=8, machines=2, parallelism_config_dp_replicate_size=4,
                                          parallelism_config_dp_shard_size=2),
                                 "warning", "parallelism_config.parallelism_config_dp_replicate_size",
                                 "one replica per machine"),
    "fsdp_config not a mapping": (top(fsdp_config=["fsdp_version: 2"]), "error", "fsdp_config", "mapping"),
}


@pytest.mark.parametrize("name", CASES)
def test_problem_is_found(name, tmp_path):
    edit, level, key, fragment = CASES[name]
    cfg = base()
    edit(cfg)
    findings = check_accelerate_config(write(tmp_path, cfg))
    matching = [f for f in findings if (f.level, f.key) == (level, key)]
    assert matching, f"expected {level} on {key}; got:\n" + "\n".join(map(str, findings))
    assert any(fragment in f.message for f in matching), "\n".join(map(str, matching))
    if level == "warning":  # a warning alone: the file still passes
        assert not [f for f in findings if f.level == "error"], "\n".join(map(str, findings))
        assert main(["check-config", str(tmp_path / "c.yaml")]) == 0
    else:
        assert main(["check-config", str(tmp_path / "c.yaml")]) == 1


def test_output_is_one_line_per_finding(tmp_path, capsys):
    cfg = base()
    cfg["fsdp_config"]["fsdp_trasformer_layer_cls_to_wrap"] = "LlamaDecoderLayer"
    path = write(tmp_path, cfg)
    assert main(["check-config", str(path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "error: fsdp_config.fsdp_trasformer_layer_cls_to_wrap: Accelerate drops unknown fsdp_config keys silently; "
        "did you mean fsdp_transformer_layer_cls_to_wrap?",
        f"{path}: 1 error, 0 warnings",
    ]


def test_unquoted_no_in_the_file(tmp_path):
    text = FSDP2_YAML.read_text().replace("mixed_precision: 'no'", "mixed_precision: no")
    assert "mixed_precision: no " in text
    (tmp_path / "c.yaml").write_text(text)
    assert ("error", "mixed_precision") in found(check_accelerate_config(tmp_path / "c.yaml"))


def test_fsdp2_config_rejections_become_errors(monkeypatch):
    from hf_fsdp2.tools import check_config

    def reject(values, source):
        raise ValueError("`reshard_after_forward`=3 must divide the shard size 2.")

    monkeypatch.setattr(check_config.FSDP2Config, "from_dict", staticmethod(reject))
    findings = check_accelerate_config_dict(base())
    assert findings == [Finding("error", "fsdp_config", "hf_fsdp2 would reject this: `reshard_after_forward`=3 "
                                                        "must divide the shard size 2.")]


# ---------------------------------------------------------------------------------------------
# What the messages claim about Accelerate, checked on the installed version


def edited(tmp_path: Path, edit, name: str = "c.yaml", source: Path = FSDP2_YAML) -> Path:
    cfg = base(source)
    edit(cfg)
    return write(tmp_path, cfg, name)


def test_accelerate_drops_unknown_fsdp_and_parallelism_keys(tmp_path, monkeypatch):
    clean = accelerate_env(edited(tmp_path, parallel(parallelism_config_dp_shard_size=4), "a.yaml"), monkeypatch)
    typos = fsdp(fsdp_trasformer_layer_cls_to_wrap="X", fsdp_frozen_dtype="bf16")
    typo = accelerate_env(edited(tmp_path, lambda c: (parallel(parallelism_config_dp_shard_size=4)(c), typos(c)),
                                 "b.yaml"), monkeypatch)
    assert typo == clean
    unprefixed = accelerate_env(edited(tmp_path, parallel(dp_shard_size=4), "c.yaml"), monkeypatch)
    assert unprefixed["PARALLELISM_CONFIG_DP_SHARD_SIZE"] == "1" and clean["PARALLELISM_CONFIG_DP_SHARD_SIZE"] == "4"


def test_accelerate_refuses_unknown_top_level_keys(tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file

    with pytest.raises(ValueError, match="mixed_precison"):
        load_config_from_file(str(edited(tmp_path, top(mixed_precison="bf16"))))


def test_accelerate_mangles_a_layer_list(tmp_path, monkeypatch):
    path = edited(tmp_path, fsdp(fsdp_transformer_layer_cls_to_wrap=["LlamaDecoderLayer", "Foo"]))
    env = accelerate_env(path, monkeypatch)
    assert env["FSDP_TRANSFORMER_CLS_TO_WRAP"] == "['LlamaDecoderLayer', 'Foo']"
    assert accelerate_plugin(env, monkeypatch).transformer_cls_names_to_wrap == ["['LlamaDecoderLayer'", " 'Foo']"]
    assert accelerate_fsdp2_config(path, monkeypatch).layer_cls_names == ("LlamaDecoderLayer", "Foo")  # repaired


def test_accelerate_ignores_layer_names_without_the_transformer_policy(tmp_path, monkeypatch):
    env = accelerate_env(edited(tmp_path, drop("fsdp_auto_wrap_policy")), monkeypatch)
    assert env["FSDP_TRANSFORMER_CLS_TO_WRAP"] == "LlamaDecoderLayer"
    assert accelerate_plugin(env, monkeypatch).transformer_cls_names_to_wrap is None


def test_accelerate_launcher_crashes_on_unquoted_no(tmp_path, monkeypatch):
    with pytest.raises(AttributeError, match="lower"):
        accelerate_env(edited(tmp_path, top(mixed_precision=False)), monkeypatch)


def test_accelerate_ignores_use_cpu_with_fsdp(tmp_path, monkeypatch):
    env = accelerate_env(edited(tmp_path, top(use_cpu=True)), monkeypatch)
    assert env["ACCELERATE_USE_FSDP"] == "true" and "ACCELERATE_USE_CPU" not in env


def test_accelerate_defaults(tmp_path, monkeypatch):
    env = accelerate_env(edited(tmp_path, lambda c: (drop("fsdp_cpu_ram_efficient_loading")(c),
                                                     drop("fsdp_version")(c))), monkeypatch)
    assert env["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "true"
    assert env["FSDP_VERSION"] == "1"


@pytest.mark.parametrize("edit", [
    fsdp(fsdp_offload_params="enabled"),
    fsdp(fsdp_reshard_after_forward=2),
    fsdp(fsdp_reshard_after_forward="SHARD_GRAD_OP"),
    fsdp(fsdp_state_dict_type="LOCAL_STATE_DICT"),
    fsdp(fsdp_activation_checkpointing_offload=True),
    fsdp(fsdp_auto_wrap_policy="LAYER_WRAP"),
    fsdp(fsdp_backward_prefetch="EARLY"),
], ids=["bool", "reshard-int", "reshard-fsdp1", "local-state-dict", "ac-offload", "wrap-policy", "prefetch"])
def test_accelerate_plugin_rejects_what_the_checker_calls_errors(edit, tmp_path, monkeypatch):
    path = edited(tmp_path, edit)
    assert any(f.level == "error" for f in check_accelerate_config(path))
    env = accelerate_env(path, monkeypatch)
    with pytest.raises((ValueError, KeyError)):
        accelerate_plugin(env, monkeypatch)


def test_accelerate_plugin_drops_what_the_checker_calls_ignored(tmp_path, monkeypatch):
    path = edited(tmp_path, fsdp(fsdp_sharding_strategy="SHARD_GRAD_OP", fsdp_backward_prefetch="BACKWARD_POST",
                                 fsdp_forward_prefetch=True))
    plugin = accelerate_plugin(accelerate_env(path, monkeypatch), monkeypatch)
    assert plugin.sharding_strategy is None and plugin.backward_prefetch is None and plugin.forward_prefetch is None
    assert plugin.reshard_after_forward is True


def test_accelerate_launcher_refuses_a_quoted_false(tmp_path, monkeypatch):
    path = edited(tmp_path, fsdp(fsdp_cpu_ram_efficient_loading="false", fsdp_sync_module_states=False))
    with pytest.raises(ValueError, match="fsdp_sync_module_states"):
        accelerate_env(path, monkeypatch)


def test_accelerate_checkpointing_needs_a_wrap_policy(tmp_path, monkeypatch):
    from accelerate.utils.fsdp_utils import fsdp2_apply_ac

    path = edited(tmp_path, lambda c: (drop("fsdp_auto_wrap_policy")(c), fsdp(fsdp_activation_checkpointing=True)(c)))
    plugin = accelerate_plugin(accelerate_env(path, monkeypatch), monkeypatch)
    assert plugin.activation_checkpointing and plugin.auto_wrap_policy is None
    with pytest.raises(TypeError, match="NoneType"):
        fsdp2_apply_ac(SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin)), nn.Sequential(nn.Linear(2, 2)))


def test_fp8_is_ours_with_torchao_and_refused_with_other_backends():
    from hf_fsdp2.integrations.accelerate import config_from_accelerator

    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    plugin = SimpleNamespace(transformer_cls_names_to_wrap=None, reshard_after_forward=True, cpu_offload=False,
                             auto_wrap_policy=transformer_auto_wrap_policy, min_num_params=0, ignored_modules=None)
    accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin), mixed_precision="fp8",
                                  parallelism_config=None, fp8_backend="FP8BackendType.AO")
    config = config_from_accelerator(accelerator)
    assert config.fp8 and config.param_dtype == torch.bfloat16
    accelerator.fp8_backend = "FP8BackendType.TE"
    with pytest.raises(ValueError, match="torchao only"):
        config_from_accelerator(accelerator)


@pytest.mark.parametrize("name, processes", [
    ("sizes do not multiply to num_processes", 4),
    ("nothing to shard over", 4),
    ("all sizes 1", 4),
])
def test_accelerate_refuses_the_parallelism_errors(name, processes, tmp_path, monkeypatch):
    edit = CASES[name][0]
    env = accelerate_env(edited(tmp_path, edit), monkeypatch)
    with pytest.raises(ValueError):
        validate_parallelism(env, processes, monkeypatch)


# ---------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize("content, fragment", [
    (None, "no such file"),
    ("fsdp_config: [unclosed\n", "not valid YAML"),
    ("- just\n- a list\n", "must be a mapping"),
    ("", "must be a mapping"),
])
def test_bad_input_names_the_file_and_exits_2(content, fragment, tmp_path, capsys):
    path = tmp_path / "in.yaml"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigFileError, match=fragment):
        check_accelerate_config(path)
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and fragment in err


def test_json_config(tmp_path):
    import json

    path = tmp_path / "c.json"
    path.write_text(json.dumps(base()))
    assert check_accelerate_config(path) == []
    path.write_text("{not json")
    with pytest.raises(ConfigFileError, match="not valid JSON"):
        check_accelerate_config(path)


def test_several_files_exit_with_the_worst_status(tmp_path):
    bad = edited(tmp_path, fsdp(fsdp_version=3))
    assert main(["check-config", *map(str, CONFIGS)]) == 0
    assert main(["check-config", str(FSDP2_YAML), str(bad)]) == 1
    assert main(["check-config", str(bad), str(tmp_path / "missing.yaml")]) == 2


def test_quoted_num_processes_only_breaks_multi_machine_launches(tmp_path, monkeypatch):
    one = edited(tmp_path, top(num_processes="2"), "one.yaml")
    assert check_accelerate_config(one) == []
    assert accelerate_env(one, monkeypatch)["ACCELERATE_USE_FSDP"] == "true"
    two = edited(tmp_path, top(num_processes="4", num_machines=2, main_process_ip="10.0.0.1"), "two.yaml")
    assert found(check_accelerate_config(two)) == {("error", "num_processes")}
    with pytest.raises(TypeError):
        accelerate_env(two, monkeypatch)


def test_checker_imports_no_accelerate():
    import subprocess
    import sys

    code = ("import sys, hf_fsdp2.tools.check_config as c; c.check_accelerate_config(sys.argv[1]); "
            "assert 'accelerate' not in sys.modules, 'accelerate imported'")
    subprocess.run([sys.executable, "-c", code, str(HSDP_YAML)], check=True, cwd=ROOT)


def test_every_accelerate_plugin_field_has_a_stated_fate():
    """Each FullyShardedDataParallelPlugin field is honoured, refused, or handled by Accelerate itself;
    a field a newer Accelerate adds fails this test until it is classified."""
    from dataclasses import fields as dataclass_fields

    from accelerate.utils import FullyShardedDataParallelPlugin

    from hf_fsdp2.integrations.accelerate import PLUGIN_FIELDS

    assert {f.name for f in dataclass_fields(FullyShardedDataParallelPlugin)} == set(PLUGIN_FIELDS)


@pytest.mark.parametrize("field, value", [("param_init_fn", lambda module: module), ("limit_all_gathers", False)])
def test_fsdp1_only_plugin_fields_are_refused_by_name(field, value, monkeypatch):
    """Stock Accelerate's FSDP2 path ignores these silently."""
    from types import SimpleNamespace

    from accelerate.utils import FullyShardedDataParallelPlugin

    from hf_fsdp2.integrations.accelerate import config_from_accelerator

    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, **{field: value})
    accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin), mixed_precision="no",
                                  parallelism_config=None)
    with pytest.raises(ValueError, match=field):
        config_from_accelerator(accelerator)
    setattr(plugin, field, FullyShardedDataParallelPlugin.__dataclass_fields__[field].default)
    assert config_from_accelerator(accelerator).wrap_policy == "none"
