"""`hf-fsdp2 config`: an Accelerate config written for one model, from the configs hf_fsdp2 ships.

Each shipped config (hf_fsdp2/configs/*.yaml, a checkout's accelerate_configs/) is a template: what the
generator changes is the model's decoder layer class (its `_no_split_modules`, read on the meta device, the
classes `shard_model` would group: sharding/groups.py `resolve_layer_class_names`; the LoRA templates leave
the line out, so the model's own `_no_split_modules` name them at run time), the number of processes
(and the data-parallel size of a TP / CP config, so the mesh still covers them) and the mixed precision; every
comment and other line stays. So the shipped files are exactly what it writes for the model they name
(Llama), which tests/test_config_writer.py keeps true. What Accelerate's yaml cannot carry (its launcher drops
keys it does not know): expert parallelism, Ulysses sequence parallelism and a memory budget for the auto layout,
is written as the HF_FSDP2_* variables the launch needs (HF_FSDP2_EP_SIZE; HF_FSDP2_SP_SIZE; HF_FSDP2_SHARD_SIZE=auto
with HF_FSDP2_MEMORY_BUDGET), in a comment at the top; EP is refused for a model without experts, SP for one whose
attention heads it cannot split. The result is checked by check-config, with those
variables, before it is written: a config hf_fsdp2 would refuse is never written.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..config import FSDP2Config

PACKAGE = Path(__file__).resolve().parent.parent
CONFIGS = PACKAGE / "configs"
TEMPLATES = ("fsdp2", "fsdp2_lora", "fsdp2_qlora", "fsdp2_tp", "fsdp2_cp", "hsdp")
_VALUE = r"(?P<value>'[^']*'|\"[^\"]*\"|[^\s#]+)"


def decoder_layer_classes(model_path: str | Path) -> tuple[str, ...]:
    """The classes `shard_model` makes one group each, for the model a config.json (or its directory) describes,
    built on the meta device."""
    from ..planner.meta_model import build_meta_model
    from ..sharding.groups import resolve_layer_class_names
    from ..sharding.model_parts import ModelParts

    model = build_meta_model(str(model_path))  # a transformers model built from its config: no PEFT around it
    return tuple(resolve_layer_class_names(ModelParts(model, model), FSDP2Config()))


def write_config(model_path: str | Path, *, template: str = "fsdp2", num_processes: int | None = None,
                 mixed_precision: str | None = None, ep_size: int = 1, memory_budget: str | int | None = None,
                 sp_size: int = 1, cp_size: int = 1) -> str:
    """The text of `template` (a shipped config's name without .yaml) for the model at `model_path`.
    `memory_budget` (bytes or "20GiB"): the auto layout's per-rank budget (`shard_size="auto"`). `sp_size`:
    hf_fsdp2's Ulysses sequence parallelism (Accelerate's own parallelism_config sp_size is DeepSpeed's); `cp_size`
    with it: hf_fsdp2's ring CP around Ulysses (HF_FSDP2_CP_SIZE; not the fsdp2_cp template's Accelerate cp)."""
    if cp_size > 1 and sp_size == 1:
        raise ValueError(f"`cp_size`={cp_size} without `sp_size`: context parallelism alone is Accelerate's "
                         "(the fsdp2_cp template, parallelism_config_cp_size); hf_fsdp2's own cp_size is ring CP "
                         "around its Ulysses: give --sp-size too.")
    if template not in TEMPLATES:
        raise ValueError(f"`template`={template!r}: choose one of {', '.join(TEMPLATES)}.")
    text = (CONFIGS / f"{template}.yaml").read_text()
    layers = ",".join(decoder_layer_classes(model_path))  # for every template: a model that cannot be grouped fails here
    if re.search(r"^\s*fsdp_transformer_layer_cls_to_wrap:", text, re.MULTILINE):  # else `_no_split_modules` names them
        text = _set(text, "fsdp_transformer_layer_cls_to_wrap", layers)
    if mixed_precision is not None:
        if mixed_precision not in ("no", "bf16", "fp16"):
            raise ValueError(f"`mixed_precision`={mixed_precision!r}: choose no, bf16 or fp16.")
        text = _set(text, "mixed_precision", f"'{mixed_precision}'")
    if num_processes is not None:
        text = _set_processes(text, num_processes)
    environ = launch_environment(ep_size, memory_budget, sp_size, cp_size)
    if environ:
        what = " and ".join(w for w, on in (("Expert parallelism", ep_size > 1), ("Sequence parallelism", sp_size > 1),
                                            ("the auto layout's memory budget", memory_budget is not None)) if on)
        variables = " ".join(f"{k}={v}" for k, v in environ.items())
        text = (f"# {what}: launch with {variables} in the environment\n"
                f"# (Accelerate's yaml cannot carry it); check with: {variables} hf-fsdp2 check-config THIS_FILE\n") + text
    _check(text, environ)  # the layout first: ep dividing the processes, not with TP/CP/HSDP
    if ep_size > 1:  # then the model: it has experts, and transformers the machinery to split them
        from ..planner.meta_model import build_meta_model
        from ..sharding import expert_parallel

        expert_parallel.require_available(ep_size)
        expert_parallel.resolved_plan(build_meta_model(str(model_path)), _int(text, "num_processes"), ep_size)
    if sp_size > 1:  # the model's attention heads split over the sp ranks (sharding/sequence_parallel.py)
        from ..planner.meta_model import build_meta_model
        from ..sharding import sequence_parallel
        from ..sharding.model_parts import ModelParts

        model = build_meta_model(str(model_path))  # built from a config: no PEFT
        sequence_parallel.refuse_unsupported(ModelParts(model, model), sp_size)
    return text


def write_file(output: str | Path, text: str, *, overwrite: bool = False) -> None:
    """`text` at `output`, whole or not at all (written beside it, then `os.replace`d onto the name). Refused if
    something is there unless `overwrite` (as `convert` refuses DST), and anywhere inside hf_fsdp2's own folder: a
    checkout's accelerate_configs/ links to the shipped templates, which `config-file` hands out. A symlink at
    `output` is replaced by the file, its target left as it was."""
    path = Path(output)
    landing = path.parent.resolve() / path.name  # the folder's links followed, the name's own not
    if landing == PACKAGE or PACKAGE in landing.parents:
        raise ValueError(f"`--output` {str(output)!r} is inside hf_fsdp2's own files ({landing}): the shipped "
                         "configs are the templates every config is written from; write yours elsewhere.")
    if os.path.lexists(path):
        if path.is_dir() and not path.is_symlink():
            raise ValueError(f"`--output` {str(output)!r} is a directory; name the file to write.")
        if not overwrite:
            raise ValueError(f"`--output` {str(output)!r} exists; pass --overwrite to replace it"
                             + (" (the link itself: its target is left as it is)." if path.is_symlink() else "."))
    partial = landing.parent / f".{path.name}.{os.getpid()}.partial"
    try:
        with open(partial, "x") as f:
            f.write(text)
        os.replace(partial, landing)
    finally:
        if os.path.lexists(partial):
            os.unlink(partial)


def _set(text: str, key: str, value: str) -> str:
    """`key: value` on its line, the line's comment and indentation kept."""
    pattern = re.compile(rf"^(?P<head>\s*{re.escape(key)}:\s*){_VALUE}", re.MULTILINE)
    if not pattern.search(text):
        raise ValueError(f"the template has no `{key}` line to set")
    return pattern.sub(lambda m: m.group("head") + value, text, count=1)


def _int(text: str, key: str) -> int:
    match = re.search(rf"^\s*{re.escape(key)}:\s*(\d+)", text, re.MULTILINE)
    return int(match.group(1)) if match else 1


def _set_processes(text: str, processes: int) -> str:
    """num_processes, and a parallelism_config's dp_shard size so that replicate x shard x tp x cp covers them."""
    if processes < 1:
        raise ValueError(f"`num_processes`={processes} must be a positive integer.")
    text = _set(text, "num_processes", str(processes))
    if "parallelism_config_dp_shard_size" in text:
        other = (_int(text, "parallelism_config_dp_replicate_size") * _int(text, "parallelism_config_tp_size")
                 * _int(text, "parallelism_config_cp_size"))
        if processes % other:
            raise ValueError(f"`num_processes`={processes} is not a multiple of the template's replicate x tp x cp = "
                             f"{other}.")
        text = _set(text, "parallelism_config_dp_shard_size", str(processes // other))
    return text


def launch_environment(ep_size: int = 1, memory_budget: str | int | None = None,
                       sp_size: int = 1, cp_size: int = 1) -> dict[str, str]:
    """The HF_FSDP2_* variables a launch with this config needs (what Accelerate's yaml cannot carry); checked
    with the text by `_check` (check-config reads them as the launch's environment)."""
    environ = {}
    if ep_size > 1:
        environ["HF_FSDP2_EP_SIZE"] = str(ep_size)
    if sp_size > 1:
        environ["HF_FSDP2_SP_SIZE"] = str(sp_size)
    if cp_size > 1:
        environ["HF_FSDP2_CP_SIZE"] = str(cp_size)
    if memory_budget is not None:
        environ["HF_FSDP2_SHARD_SIZE"] = "auto"
        environ["HF_FSDP2_MEMORY_BUDGET"] = str(memory_budget)
    return environ


def _check(text: str, environ: dict[str, str]) -> None:
    """check-config on the text, with the variables the launch will set (and no other HF_FSDP2_* variable: the
    file must stand on its own); any error refuses the config."""
    import tempfile

    from . import check_config

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.yaml"
        path.write_text(text)
        findings = check_config.check_accelerate_config(path, environ)
    errors = [f for f in findings if f.level == "error"]
    if errors:
        raise ValueError("hf_fsdp2 would refuse this config: " + "; ".join(f"{f.key}: {f.message}" for f in errors))


__all__ = ["TEMPLATES", "decoder_layer_classes", "launch_environment", "write_config", "write_file"]
