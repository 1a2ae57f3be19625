"""A short Accelerate FSDP2 job that ends right after one kind of last collective (for the exit
tests and `benchmarks/exit_stress.py`). Exits 0 when all went well; the launcher reports any abort.

--ending: get_state_dict | save_state | save_model | all_reduce (a user's `accelerator.reduce`)
--end-training: call `accelerator.end_training()` (destroys the process group) before exiting
--no-guard: take hf_fsdp2's exit guard off, to show what happens without it
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

parser = argparse.ArgumentParser()
parser.add_argument("--ending", required=True, choices=["get_state_dict", "save_state", "save_model", "all_reduce"])
parser.add_argument("--end-training", action="store_true")
parser.add_argument("--no-guard", action="store_true")
parser.add_argument("--out", default=None, help="directory for save_state / save_model")
args = parser.parse_args()

import torch  # noqa: E402

import hf_fsdp2  # noqa: E402
from tests.common import batches, build_model  # noqa: E402

if args.no_guard:
    hf_fsdp2.runtime.exit_guard.uninstall()
hf_fsdp2.register()
from accelerate import Accelerator  # noqa: E402

accelerator = Accelerator()
model = build_model(num_hidden_layers=2)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, opt = accelerator.prepare(model, opt)
ids = batches(steps=1, batch=2)[0]
accelerator.backward(model(input_ids=ids, labels=ids).loss)
opt.step()
opt.zero_grad()
if args.ending == "get_state_dict":
    accelerator.get_state_dict(model)
elif args.ending == "save_state":
    accelerator.save_state(str(Path(args.out) / "state"))
elif args.ending == "save_model":
    accelerator.save_model(model, str(Path(args.out) / "model"))
else:
    accelerator.reduce(torch.ones(4), reduction="sum")
if args.end_training:
    accelerator.end_training()
