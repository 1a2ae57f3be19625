"""A model's route through hf_fsdp2, as it runs (issues 50, 62): which of the package's files a PEFT LoRA model is
handed to, in order, on four entries: Accelerate's prepare (`_fsdp2_prepare_model`), `shard_model`,
`hf_fsdp2.from_pretrained` and `save_pretrained`.

    accelerate launch --config_file accelerate_configs/fsdp2_lora.yaml benchmarks/route.py [--out FILE]

Counted on rank 0, for each entry: every call into a function of hf_fsdp2 that receives the model (the PeftModel,
the transformers model under it, or an object holding them: sharding/model_parts.ModelParts, or a dataclass with
one of those in a field, such as shard.py's Layout) as an argument; consecutive calls in one file are one stay.
from_pretrained's model is the one it returns (made inside it): calls are noted with their arguments and matched
once it has returned. Calls into runtime/ (the bottom layer: collectives, upstream's seams) are listed apart and
left out of the route: a return from there is no climb back up. `files`: distinct files entered (runtime/ apart);
`returns`: stays in a file the route had already left; `entered`: how many stays each of sharding/record.py and
sharding/model_parts.py has (issue 62: at most one each). Another checkout's route (an older commit, for
comparison): put it first on the path, `PYTHONPATH=/path/to/checkout accelerate launch ... benchmarks/route.py`;
`source` in the output says which checkout ran.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

RUNTIME = "runtime/"
WATCHED = ("sharding/record.py", "sharding/model_parts.py")  # looked up once per entry (issue 62)


def _tracked(model) -> list:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return [model, base]


def _holds(value, tracked: list) -> bool:
    """The model itself, or an object holding the model as `model` (sharding/model_parts.ModelParts, read without
    importing it: older checkouts have no such class)."""
    return any(value is t for t in tracked) or (
        getattr(value, "model", None) is tracked[0] and not isinstance(value, type))


def _is_model(value, tracked: list) -> bool:
    if _holds(value, tracked):
        return True
    # a dataclass with one of those in a field (shard.py's Layout carries the parts; a plan object would)
    return dataclasses.is_dataclass(value) and not isinstance(value, type) and any(
        _holds(getattr(value, f.name, None), tracked) for f in dataclasses.fields(value))


def _candidate(value, module_class: type) -> bool:
    """What may be the model or hold it, kept while the entry runs (from_pretrained's model is known after)."""
    return isinstance(value, module_class) or dataclasses.is_dataclass(value) or hasattr(type(value), "model")


def trace_route(action, model, package: Path) -> dict:
    """Run `action()` with a profiler that notes each hf_fsdp2 function called with the model as an argument;
    `model`: the model handed to the entry, or None: the one `action()` returns."""
    import torch.nn as nn

    calls: list[tuple[str, list]] = []  # (file, the arguments that may be the model)
    prefix = str(package) + "/"

    def profiler(frame, event, arg):
        if event != "call" or not frame.f_code.co_filename.startswith(prefix):
            return
        code = frame.f_code
        names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
        values = [v for v in (frame.f_locals.get(n) for n in names) if v is not None and _candidate(v, nn.Module)]
        if values:
            calls.append((str(Path(code.co_filename).relative_to(package)), values))

    sys.setprofile(profiler)
    try:
        result = action()
    finally:
        sys.setprofile(None)
    tracked = _tracked(model if model is not None else result)
    stays: list[str] = []
    runtime: list[str] = []
    for path, values in calls:
        if not any(_is_model(v, tracked) for v in values):
            continue
        if path.startswith(RUNTIME):
            runtime.append(path)
        elif not stays or stays[-1] != path:
            stays.append(path)
    seen: set[str] = set()
    returns = 0
    for path in stays:
        returns += path in seen
        seen.add(path)
    return {"files": len(seen), "returns": returns, "stays": len(stays),
            "entered": {path: stays.count(path) for path in WATCHED}, "runtime_calls": len(runtime),
            "route": stays}


def _base_model(seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(config)


def _lora():
    from peft import LoraConfig

    return LoraConfig(r=4, target_modules=["q_proj", "v_proj"])


def _peft_model(seed: int):
    from peft import get_peft_model

    return get_peft_model(_base_model(seed), _lora())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write the routes as JSON here (rank 0)")
    args = parser.parse_args()

    import torch
    from accelerate import Accelerator

    import hf_fsdp2

    hf_fsdp2.register()
    package = Path(hf_fsdp2.__file__).resolve().parent
    accelerator = Accelerator()
    routes = {}

    model = _peft_model(0)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    prepared = {}

    def prepare():
        prepared["model"], prepared["optimizer"] = accelerator.prepare(model, optimizer)

    routes["accelerate_prepare"] = trace_route(prepare, model, package)

    other = _peft_model(1)
    routes["shard_model"] = trace_route(lambda: hf_fsdp2.shard_model(other), other, package)

    # a directory of the base model's weights for from_pretrained (rank 0 writes it, every rank reads its rows)
    source = Path(tempfile.gettempdir()) / f"hf_fsdp2_route_source_{os.environ.get('MASTER_PORT', '0')}"
    if accelerator.is_main_process:
        _base_model(2).save_pretrained(source)
    accelerator.wait_for_everyone()
    from transformers import LlamaForCausalLM

    routes["from_pretrained"] = trace_route(
        lambda: hf_fsdp2.from_pretrained(LlamaForCausalLM, source, peft_config=_lora()), None, package)

    # one directory every rank writes into (same machine): named after the launch's rendezvous port
    directory = Path(tempfile.gettempdir()) / f"hf_fsdp2_route_{os.environ.get('MASTER_PORT', '0')}"
    target = prepared["model"]
    routes["save_pretrained"] = trace_route(lambda: hf_fsdp2.save_pretrained(target, directory), target, package)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        shutil.rmtree(directory, ignore_errors=True)
        shutil.rmtree(source, ignore_errors=True)
        result = {"source": str(package.parent), "routes": routes}
        for name, route in routes.items():
            entered = "  ".join(f"{Path(p).name} {n}" for p, n in route["entered"].items())
            print(f"{name:20s} files {route['files']:3d}  returns {route['returns']:3d}  stays {route['stays']:3d}  "
                  f"entered: {entered}")
        if args.out is not None:
            args.out.write_text(json.dumps(result, indent=1))
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
