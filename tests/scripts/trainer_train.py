"""A Transformers Trainer script: `--fsdp full_shard --fsdp_config accelerate_configs/fsdp2.json`
plus `hf_fsdp2.register()` engages hf_fsdp2. Run by the tests under torchrun."""

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from transformers import HfArgumentParser, Trainer, TrainingArguments  # noqa: E402

import hf_fsdp2  # noqa: E402
from hf_fsdp2.sharding import record_of  # noqa: E402
from hf_fsdp2.sharding.replication import is_replicated  # noqa: E402
from tests import nccl_like  # noqa: E402

nccl_like.init_if_asked()  # TEST_DEFAULT_BACKEND=cuda:gloo: GPU process-group semantics (tests/test_gpu_semantics.py)
from tests.common import batches, build_model, lora  # noqa: E402


@dataclass
class ScriptArguments:
    report: str = field(metadata={"help": "JSON file for losses (rank 0)"})
    lora: bool = False
    resume: str | None = None
    final_dir: str | None = None
    eval: bool = False
    load_in_4bit: str | None = None  # a float model directory, loaded by stock transformers in 4-bit (QLoRA)
    model_shape: str | None = None  # JSON: LlamaConfig overrides of the tiny model (tests.common.tiny_config)
    hf_fsdp2_from_pretrained: str | None = None  # a model directory, loaded and sharded by hf_fsdp2.from_pretrained
    model_dir: str | None = None  # a model directory, loaded whole by stock from_pretrained (the Trainer shards it)


def main():
    hf_fsdp2.register()  # before TrainingArguments: on a CPU-only machine it makes --fsdp start gloo
    args, script = HfArgumentParser((TrainingArguments, ScriptArguments)).parse_args_into_dataclasses()
    if script.load_in_4bit:
        from transformers import AutoModelForCausalLM, BitsAndBytesConfig

        model = AutoModelForCausalLM.from_pretrained(script.load_in_4bit, device_map="cpu", dtype=torch.float32,
                                                     quantization_config=BitsAndBytesConfig(
                                                         load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32))
    elif script.hf_fsdp2_from_pretrained:  # sharded before the Trainer sees it: no rank holds the whole model
        from peft import LoraConfig
        from transformers import AutoModelForCausalLM

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                 lora_dropout=0.0) if script.lora else None
        model = hf_fsdp2.from_pretrained(AutoModelForCausalLM, script.hf_fsdp2_from_pretrained,
                                         peft_config=peft_config)
    elif script.model_dir:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(script.model_dir, dtype=torch.float32)
    else:
        model = build_model(**json.loads(script.model_shape or "{}"))
    if script.lora and not script.hf_fsdp2_from_pretrained:
        model = lora(model)
    rows = torch.cat(batches(steps=12, batch=8))
    dataset = [{"input_ids": r, "labels": r} for r in rows]
    trainer = Trainer(model=model, args=args, train_dataset=dataset, eval_dataset=dataset[:8] if script.eval else None)
    lengths = set()  # the sequence lengths the model embeds in training (under Ulysses: each rank's slice)
    model.get_input_embeddings().register_forward_hook(
        lambda module, args, out: lengths.add(args[0].shape[-1]) if module.training else None)
    trainer.train(resume_from_checkpoint=script.resume)
    if script.final_dir:
        trainer.save_model(script.final_dir)
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
    from torch.distributed.tensor import DTensor

    groups = [m._get_fsdp_state()._fsdp_param_group for m in model.modules() if isinstance(m, FSDPModule)]
    groups = [g for g in groups if g is not None]
    mesh = getattr(record_of(model), "mesh", None)
    if trainer.is_world_process_zero():
        losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
        Path(script.report).write_text(json.dumps({
            "losses": losses, "all_dtensor": all(isinstance(p, DTensor) for p in model.parameters()),
            # on one process (a one-rank shard group) frozen weights stay plain tensors, outside FSDP
            "trainable_dtensor": all(isinstance(p, DTensor) for p in model.parameters() if p.requires_grad),
            "frozen_plain": all(not isinstance(p, DTensor) for p in model.parameters() if not p.requires_grad),
            "world": trainer.args.world_size, "embedded_lengths": sorted(lengths),
            "total_train_batch_size": trainer.get_total_train_batch_size(trainer.args),
            "mesh": dict(zip(mesh.mesh_dim_names, mesh.shape)) if mesh is not None else None,
            "expert_mesh": sorted({(p.device_mesh.mesh_dim_names, tuple(p.device_mesh.shape)) for p in model.parameters()
                                   if isinstance(p, DTensor) and "ep" in (p.device_mesh.mesh_dim_names or ())}),
            "packed_4bit_rows": [[p.to_local().shape[0], p.shape[0]] for p in model.parameters()
                                 if p.dtype == torch.uint8 and isinstance(p, DTensor)], "offload": all(isinstance(g.offload_policy, CPUOffloadPolicy) for g in groups),
            "async_save": getattr(getattr(record_of(model), "config", None), "async_save", None),
            "ddp_reducer": is_replicated(model),  # shard size 1: DDP's reducer (sharding/replication.py)
            "reshard_after_forward": any(g.post_forward_mesh_info is not None for g in groups), "best_model_checkpoint": trainer.state.best_model_checkpoint,
            "optimizer": type(trainer.optimizer.optimizer).__name__,
            "state_dtypes": sorted({str(v.dtype) for s in trainer.optimizer.state.values() for k, v in s.items()
                                    if k == "state1"}),
            "eval_losses": {h["step"]: h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h}}))


if __name__ == "__main__":
    main()
