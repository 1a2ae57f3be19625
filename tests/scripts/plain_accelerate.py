"""A plain Accelerate loop that never imports hf_fsdp2: the shape of a script whose code the user does not
edit. It reports whether hf_fsdp2 was loaded into the process anyway (`hf-fsdp2 run`) and sharded the model."""

import argparse
import json
import sys

import torch
from accelerate import Accelerator
from transformers import LlamaConfig, LlamaForCausalLM

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
args = parser.parse_args()

torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
accelerator = Accelerator()
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, opt = accelerator.prepare(model, opt)
ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(accelerator.process_index))
loss = model(input_ids=ids, labels=ids).loss
accelerator.backward(loss)
opt.step()
ours = sys.modules.get("hf_fsdp2")
report = {"hf_fsdp2_loaded": ours is not None,
          "sharded_by_hf_fsdp2": bool(ours is not None and ours.sharding.is_sharded(accelerator.unwrap_model(model))),
          "loss": loss.item()}
if accelerator.is_main_process:
    with open(args.out, "w") as f:
        json.dump(report, f)
