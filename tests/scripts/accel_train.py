"""A standard Accelerate training loop, run under `accelerate launch` by the tests."""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from tests.common import batches, build_model, lora  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--start", type=int, default=0)
parser.add_argument("--per-device-batch", type=int, default=4)
parser.add_argument("--accum", type=int, default=1)
parser.add_argument("--lora", action="store_true")
parser.add_argument("--lora-zero-b", action="store_true", help="with --lora: PEFT's default init (B = 0), so the "
                    "first forward is the base model's")
parser.add_argument("--adapter", help="continue training a saved PEFT adapter: PeftModel.from_pretrained(model, ADAPTER, "
                    "is_trainable=True) before prepare")
parser.add_argument("--no-register", action="store_true")
parser.add_argument("--foreign-patch", action="store_true", help="rebind fsdp2_prepare_model after register()")
parser.add_argument("--save-model")
parser.add_argument("--save-state")
parser.add_argument("--load-state")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--from-pretrained", help="load the base model with transformers' from_pretrained")
parser.add_argument("--hf-fsdp2-from-pretrained", help="load (and shard) the base model with hf_fsdp2.from_pretrained "
                    "before prepare, as accelerate_configs/fsdp2.yaml recommends (with --lora: its peft_config)")
parser.add_argument("--fsdp2-config", default="{}", help="with --hf-fsdp2-from-pretrained: FSDP2Config fields (JSON), "
                    "or 'accelerator': hf_fsdp2.accelerator_config(accelerator), the launch's own settings")
parser.add_argument("--load-in-4bit", action="store_true", help="with --from-pretrained: stock bitsandbytes 4-bit load")
parser.add_argument("--fsdp-size", type=int, help="with --from-pretrained: transformers shards it at load "
                    "(DistributedConfig(fsdp_size=N))")
parser.add_argument("--load-weights", help="with --from-pretrained: model.load_state_dict(safetensors file) right after "
                    "the load (on a deferred model: before prepare)")
parser.add_argument("--zero-lm-head", action="store_true", help="zero lm_head's weight in place before prepare")
parser.add_argument("--scramble-other-ranks", action="store_true",
                    help="every rank but 0 changes its loaded weights before prepare (fsdp_cpu_ram_efficient_loading "
                         "must give every shard rank 0's)")
args = parser.parse_args()

import hf_fsdp2  # noqa: E402
from hf_fsdp2.sharding import record_of  # noqa: E402
from hf_fsdp2.sharding.replication import is_replicated  # noqa: E402
from hf_fsdp2.sharding.compile.compiled_collectives import is_traced  # noqa: E402
from tests import nccl_like  # noqa: E402

nccl_like.init_if_asked()  # TEST_DEFAULT_BACKEND=cuda:gloo: GPU process-group semantics (tests/test_gpu_semantics.py)

if not args.no_register:
    hf_fsdp2.register()
if args.foreign_patch:  # as axolotl's patch_accelerate_fsdp2() does at model load, after register()
    import accelerate.accelerator

    def foreign_fsdp2_prepare_model(accelerator, model):
        raise AssertionError("the foreign patch ran")

    accelerate.accelerator.fsdp2_prepare_model = foreign_fsdp2_prepare_model
from accelerate import Accelerator  # noqa: E402

# The scheduler steps once per optimizer step whatever the process count (comparable across world sizes).
accelerator = Accelerator(gradient_accumulation_steps=args.accum, step_scheduler_with_optimizer=False)
if args.from_pretrained:
    from transformers import AutoModelForCausalLM

    quantized = {}
    if args.load_in_4bit:  # QLoRA as users load it: the whole 4-bit model on every rank until prepare()
        from transformers import BitsAndBytesConfig

        quantized = dict(quantization_config=BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_quant_storage=torch.bfloat16, bnb_4bit_compute_dtype=torch.float32),
            device_map="cpu", dtype=torch.float32)
    if args.fsdp_size:
        from transformers.distributed import DistributedConfig

        quantized["distributed_config"] = DistributedConfig(fsdp_size=args.fsdp_size)
    model = AutoModelForCausalLM.from_pretrained(args.from_pretrained, **quantized)
    # Built on meta on every rank (hf_fsdp2 deferred the load to prepare: integrations/deferred_load.py)?
    on_meta = torch.tensor([float(all(p.is_meta for p in model.parameters()))])
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(on_meta, op=torch.distributed.ReduceOp.MIN)
    loaded_on_meta_everywhere = bool(on_meta.item())
    if args.load_weights:
        from safetensors.torch import load_file

        model.load_state_dict(load_file(args.load_weights))
elif args.hf_fsdp2_from_pretrained:
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    peft_config = None
    if args.lora:  # tests.common.lora's settings, as a config: hf_fsdp2.from_pretrained applies it before sharding
        torch.manual_seed(args.seed)
        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0,
                                 init_lora_weights=True if args.lora_zero_b else False)
    quantized = {}
    if args.load_in_4bit:  # QLoRA as fsdp2_qlora.yaml recommends: each rank quantizes only its rows
        from transformers import BitsAndBytesConfig

        quantized = dict(quantization_config=BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_quant_storage=torch.bfloat16, bnb_4bit_compute_dtype=torch.bfloat16))
    model = hf_fsdp2.from_pretrained(AutoModelForCausalLM, args.hf_fsdp2_from_pretrained,
                                     hf_fsdp2.accelerator_config(accelerator) if args.fsdp2_config == "accelerator"
                                     else hf_fsdp2.FSDP2Config(**json.loads(args.fsdp2_config)), peft_config=peft_config,
                                     # Accelerate's mesh when it has one (parallelism_config: TP, CP, HSDP), as prepare
                                     mesh=accelerator.torch_device_mesh if args.fsdp2_config == "accelerator" else None,
                                     **quantized)
else:
    model = build_model(seed=args.seed)
if args.lora and not args.hf_fsdp2_from_pretrained:
    model = lora(model, seed=args.seed, **({"init_lora_weights": True} if args.lora_zero_b else {}))
if args.adapter:
    from peft import PeftModel

    model = PeftModel.from_pretrained(model, args.adapter, is_trainable=True)
if args.zero_lm_head:
    with torch.no_grad():
        model.get_output_embeddings().weight.zero_()
if args.scramble_other_ranks and accelerator.process_index != 0:
    with torch.no_grad():
        for p in model.parameters():
            if p.dtype.is_floating_point and p.dtype.itemsize >= 4:
                p.add_(1.0)
            else:  # packed 4-bit bytes (any quant_storage)
                p.view(torch.uint8).bitwise_xor_(0x5A)
            state = getattr(p, "quant_state", None)
            if state is not None:  # 4-bit quantization state
                (state.state2.absmax if state.nested else state.absmax).mul_(2)
                if state.nested:
                    state.offset += 1
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
# The ranks of one tensor-parallel group share a batch: the data splits over the data-parallel ranks.
tp_size = accelerator.parallelism_config.tp_size if accelerator.parallelism_config else 1
cp_size = accelerator.parallelism_config.cp_size if accelerator.parallelism_config else 1
rows_per_step = args.per_device_batch * (accelerator.num_processes // (tp_size * cp_size)) * args.accum
rows = torch.cat(batches(steps=args.start + args.steps, batch=rows_per_step))
data = DataLoader(list(rows[args.start * rows_per_step:]), batch_size=args.per_device_batch, shuffle=False)
model, opt, data, sched = accelerator.prepare(model, opt, data, sched)
if args.load_state:
    accelerator.load_state(args.load_state)


def forward_backward(ids: torch.Tensor) -> torch.Tensor:
    if cp_size == 1:
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        return loss
    # Context parallelism as Accelerate's nd_parallel example and the Trainer do it: labels shifted before
    # the sequence is split, positions passed, forward and backward inside maybe_context_parallel. Each CP
    # rank sums its tokens' losses over the batch's token count / cp_size, so the CP group's mean (FSDP2
    # averages gradients over dp_shard x cp) is the batch's mean loss, as one process computes it.
    inputs, labels = ids.clone(), ids.clone()
    shift = torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:].contiguous()
    positions = torch.arange(ids.shape[1]).expand_as(ids).clone()
    items = (shift != -100).sum() / cp_size
    buffers = [inputs, labels, shift, positions]
    with accelerator.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1] * 4, no_restore_buffers=set(buffers)):
        loss = model(input_ids=inputs, labels=labels, shift_labels=shift, position_ids=positions,
                     num_items_in_batch=items).loss
        accelerator.backward(loss)
    return loss


losses, micro = [], []
for ids in data:
    with accelerator.accumulate(model):
        loss = forward_backward(ids)
        if accelerator.sync_gradients:
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()  # AcceleratedOptimizer skips it on accumulation micro-steps
        if accelerator.sync_gradients:
            sched.step()  # stepped by us once per optimizer step (step_scheduler_with_optimizer=False)
        opt.zero_grad()
    micro.append(accelerator.reduce(loss.detach(), reduction="mean").item())
    if accelerator.sync_gradients:
        losses.append(sum(micro) / len(micro))
        micro = []
from torch.distributed.tensor import DTensor  # noqa: E402

report = {
    "losses": losses,
    "distributed_type": str(accelerator.distributed_type),
    "all_dtensor": all(isinstance(p, DTensor) for p in model.parameters()),
    "opt_params_are_model_params": {id(p) for g in opt.param_groups for p in g["params"]}
    <= {id(p) for p in model.parameters()},
    "world": accelerator.num_processes,
    "async_save": getattr(getattr(record_of(model), "config", None), "async_save", None),  # None: not ours
    "fp8_linears": sum(type(m).__name__ == "Float8Linear" for m in model.modules()),
    "fp8_scales_precomputed": all(getattr(m.weight._local_tensor, "_precomputed_scale", None) is not None
                                  for m in model.modules() if type(m).__name__ == "Float8Linear"),
    "packed_4bit_rows": [[p.to_local().shape[0], p.shape[0]] for p in model.parameters() if p.dtype == torch.uint8],
    "mesh": list(getattr(getattr(record_of(model), "mesh", None), "shape", ())),
    "expert_mesh": sorted({(p.device_mesh.mesh_dim_names, tuple(p.device_mesh.shape)) for p in model.parameters()
                           if isinstance(p, DTensor) and "ep" in (p.device_mesh.mesh_dim_names or ())}),
    "ddp_reducer": is_replicated(model),  # shard size 1: DDP's reducer (sharding/replication.py)
    "compiled_collectives": is_traced(record_of(model)),  # compile="model" (sharding/compile/compiled_collectives.py)
    "compiled_modules": sum(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules()),
    "reshard_after_forward": getattr(getattr(record_of(model), "config", None), "reshard_after_forward", None),
    "loaded_on_meta_everywhere": loaded_on_meta_everywhere if args.from_pretrained else None,
}
from tests.common import FSDP_REDUCE_SCATTER, count_collectives  # noqa: E402

if args.accum > 1:  # an accumulation micro-step inside accelerator.accumulate(): no reduce-scatter
    ids = next(iter(data))
    with count_collectives() as calls, accelerator.accumulate(model):
        assert not accelerator.sync_gradients
        accelerator.backward(model(input_ids=ids, labels=ids).loss)
    report["reduce_scatters_in_accumulation_step"] = calls[FSDP_REDUCE_SCATTER]
    opt.zero_grad()
report["state_dict_keys"] = len(accelerator.get_state_dict(model))
if args.save_model:
    accelerator.save_model(model, args.save_model)
if args.save_state:
    accelerator.save_state(args.save_state)
if accelerator.is_main_process:
    Path(args.out).write_text(json.dumps(report))
accelerator.end_training()
