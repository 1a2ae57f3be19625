"""TRL trainers (DPO with a reference model, GRPO with beta > 0, on-policy distillation with a teacher) under `accelerate launch` with
`hf_fsdp2.register()` (or without, `--no-register`). Run by tests/test_trl.py."""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--trainer", choices=["dpo", "grpo", "distill"], required=True)
parser.add_argument("--model", required=True, help="a saved model directory with its tokenizer")
parser.add_argument("--out", required=True)
parser.add_argument("--output-dir", required=True)
parser.add_argument("--steps", type=int, default=2)
parser.add_argument("--per-device-batch", type=int, default=2)
parser.add_argument("--lora", action="store_true")
parser.add_argument("--no-register", action="store_true")
parser.add_argument("--reward-model", help="GRPO: a sequence-classification model directory as a second reward")
parser.add_argument("--teacher", help="distill: the teacher's model directory")
parser.add_argument("--save-steps", type=int, help="checkpoint every N steps (hf_fsdp2's training states)")
parser.add_argument("--resume", help="a checkpoint directory to resume from")
parser.add_argument("--greedy", action="store_true",
                    help="GRPO: greedy completions (top_k=1), the same whatever the rank count")
args = parser.parse_args()

if not args.no_register:
    import hf_fsdp2

    hf_fsdp2.register()
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

WORDS = [line.split() for line in (Path(__file__).resolve().parents[2] / "examples" / "data" / "train.txt")
         .read_text().splitlines() if len(line.split()) >= 6][:16]
tokenizer = AutoTokenizer.from_pretrained(args.model)
model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
peft_config = None
if args.lora:
    from peft import LoraConfig

    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
common = dict(output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=args.per_device_batch,
              learning_rate=1e-3, logging_steps=1, report_to=[], seed=0, data_seed=0,
              save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
              gradient_checkpointing=False, bf16=False)
if args.trainer == "dpo":
    from trl import DPOConfig, DPOTrainer

    data = Dataset.from_list([{"prompt": " ".join(w[:3]), "chosen": " " + " ".join(w[3:6]),
                               "rejected": " " + " ".join(reversed(w[3:6]))} for w in WORDS])
    trainer = DPOTrainer(model=model, args=DPOConfig(beta=0.1, max_length=32, **common), train_dataset=data,
                         processing_class=tokenizer, peft_config=peft_config)
elif args.trainer == "distill":
    from trl import DistillationConfig, DistillationTrainer

    teacher = AutoModelForCausalLM.from_pretrained(args.teacher, dtype=torch.float32)
    data = Dataset.from_list([{"prompt": " ".join(w[:4])} for w in WORDS])
    # top_k=1: the student's own completions are its greedy ones, the same whatever the rank count.
    trainer = DistillationTrainer(model=model, teacher_model=teacher, train_dataset=data, processing_class=tokenizer,
                                  peft_config=peft_config,
                                  args=DistillationConfig(max_completion_length=4, top_k=1, **common))
else:
    from trl import GRPOConfig, GRPOTrainer

    def reward(completions, **kwargs):
        return [float(len(c)) for c in completions]

    data = Dataset.from_list([{"prompt": " ".join(w[:4])} for w in WORDS])
    rewards = [reward]
    if args.reward_model:
        from transformers import AutoModelForSequenceClassification

        rewards.append(AutoModelForSequenceClassification.from_pretrained(args.reward_model, dtype=torch.float32))
    trainer = GRPOTrainer(model=model, reward_funcs=rewards, train_dataset=data, processing_class=tokenizer,
                          peft_config=peft_config,
                          args=GRPOConfig(beta=0.1, num_generations=2, max_completion_length=4, temperature=1.0,
                                          top_k=1 if args.greedy else 0,
                                          model_init_kwargs={"dtype": torch.float32}, **common))
trainer.train(resume_from_checkpoint=args.resume)

from torch.distributed.tensor import DTensor  # noqa: E402

def describe(m):
    return None if m is None else {
        "class": type(m).__name__,
        "frozen": all(not p.requires_grad for p in m.parameters()),
        "dtensor": all(isinstance(p, DTensor) for p in m.parameters()),
        "groups": sum(type(x).__name__.startswith("FSDP") for x in m.modules()),
        "grads": sum(p.grad is not None for p in m.parameters()),
    }


ref = getattr(trainer, "ref_model", None)
report = {
    "reward_models": [describe(f) for f in getattr(trainer, "reward_funcs", []) if isinstance(f, torch.nn.Module)],
    "world": trainer.accelerator.num_processes,
    "global_step": trainer.state.global_step,
    "steps_logged": [e["step"] for e in trainer.state.log_history if "loss" in e],
    "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
    "logs": [e for e in trainer.state.log_history if "loss" in e],
    "policy_dtensor": all(isinstance(p, DTensor) for p in trainer.model.parameters()),
    "ref_model": describe(ref),
    "teacher_model": describe(getattr(trainer, "teacher_model", None)),
}
if trainer.accelerator.is_main_process:
    Path(args.out).write_text(json.dumps(report))
trainer.accelerator.wait_for_everyone()
