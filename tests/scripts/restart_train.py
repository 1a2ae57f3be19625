"""An Accelerate loop that saves every N steps and resumes from the latest complete checkpoint,
run under `torchrun --max-restarts 1`; `--crash-at-step` SIGKILLs rank 1 on the first attempt."""

import argparse
import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import hf_fsdp2  # noqa: E402
from hf_fsdp2.checkpoint.state import latest_state  # noqa: E402
from tests.common import batches, build_model  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--root", required=True)
parser.add_argument("--loss-file", required=True)
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--save-every", type=int, default=2)
parser.add_argument("--crash-at-step", type=int, default=0)
args = parser.parse_args()

attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
if attempt:
    # After a restart, gloo's rendezvous can read the dead attempt's addresses from torchrun's store
    # (torch 2.13: "Gloo connectFullMesh failed ... Connection refused"); a fresh store per attempt
    # avoids it. See README "Failures and timeouts".
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"
    os.environ["MASTER_PORT"] = str(int(os.environ["MASTER_PORT"]) + attempt)
hf_fsdp2.register()
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import FullyShardedDataParallelPlugin  # noqa: E402

accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap"))
model = build_model()
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
rows = torch.cat(batches(steps=args.steps, batch=8))
data = DataLoader(list(rows), batch_size=8 // accelerator.num_processes, shuffle=False)
model, opt, data = accelerator.prepare(model, opt, data)
start = 0
latest = latest_state(args.root)
if latest is not None:  # --resume auto
    accelerator.load_state(latest)
    start = int(latest.name.split("-")[1])
    data = accelerator.skip_first_batches(data, start)
for step, ids in enumerate(data, start=start + 1):
    loss = model(input_ids=ids, labels=ids).loss
    accelerator.backward(loss)
    opt.step()
    opt.zero_grad()
    loss = accelerator.reduce(loss.detach(), reduction="mean").item()
    if accelerator.is_main_process:
        with open(args.loss_file, "a") as f:
            f.write(json.dumps({"step": step, "loss": loss, "attempt": attempt}) + "\n")
    if step % args.save_every == 0:
        accelerator.save_state(os.path.join(args.root, f"step-{step}"))
    if step == args.crash_at_step and attempt == 0 and accelerator.process_index == 1:
        os.kill(os.getpid(), signal.SIGKILL)
accelerator.wait_for_everyone()
accelerator.end_training()
