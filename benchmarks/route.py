"""A model's route through hf_fsdp2, as it runs (issue 50): which of the package's files a PEFT LoRA model is
handed to, in order, on three paths: Accelerate's prepare (`_fsdp2_prepare_model`), `shard_model`, and
`save_pretrained`.

    accelerate launch --config_file accelerate_configs/fsdp2_lora.yaml benchmarks/route.py [--out FILE]

Counted on rank 0, for each path: every call into a function of hf_fsdp2 that receives the model (the PeftModel,
the transformers model under it, or one object holding them) as an argument; consecutive calls in one file are one
stay. `files`: distinct files entered; `returns`: stays in a file the route had already left. Another checkout's
route (an older commit, for comparison): put it first on the path, `PYTHONPATH=/path/to/checkout accelerate launch
... benchmarks/route.py`; `source` in the output says which checkout ran.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path


def _tracked(model) -> list:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return [model, base]


def _is_model(value, tracked: list) -> bool:
    if any(value is t for t in tracked):
        return True
    # an object holding the model (sharding/model_parts.ModelParts), read without importing it: older
    # checkouts have no such class
    return getattr(value, "model", None) is tracked[0] and not isinstance(value, type)


def trace_route(action, model, package: Path) -> dict:
    """Run `action()` with a profiler that notes each hf_fsdp2 function called with `model` as an argument."""
    tracked = _tracked(model)
    stays: list[str] = []
    prefix = str(package) + "/"

    def profiler(frame, event, arg):
        if event != "call" or not frame.f_code.co_filename.startswith(prefix):
            return
        code = frame.f_code
        names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
        if any(_is_model(frame.f_locals.get(n), tracked) for n in names):
            path = str(Path(code.co_filename).relative_to(package))
            if not stays or stays[-1] != path:
                stays.append(path)

    sys.setprofile(profiler)
    try:
        action()
    finally:
        sys.setprofile(None)
    seen: set[str] = set()
    returns = 0
    for path in stays:
        returns += path in seen
        seen.add(path)
    return {"files": len(seen), "returns": returns, "stays": len(stays), "route": stays}


def _peft_model(seed: int):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return get_peft_model(LlamaForCausalLM(config), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))


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

    # one directory every rank writes into (same machine): named after the launch's rendezvous port
    directory = Path(tempfile.gettempdir()) / f"hf_fsdp2_route_{os.environ.get('MASTER_PORT', '0')}"
    target = prepared["model"]
    routes["save_pretrained"] = trace_route(lambda: hf_fsdp2.save_pretrained(target, directory), target, package)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        shutil.rmtree(directory, ignore_errors=True)
        result = {"source": str(package.parent), "routes": routes}
        for name, route in routes.items():
            print(f"{name:20s} files {route['files']:3d}  returns {route['returns']:3d}  stays {route['stays']:3d}")
        if args.out is not None:
            args.out.write_text(json.dumps(result, indent=1))
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
