"""Fine-tune a causal language model with FSDP2 through a plain Accelerate loop.

    accelerate launch --config_file accelerate_configs/fsdp2.yaml examples/finetune.py

With no flags it trains the embedded tiny Llama (`examples/tiny-llama`: a config and a tokenizer,
weights initialised with a fixed seed) on the bundled toy corpus (`examples/data`), on 2 CPU
processes (gloo) or on the GPUs, in under 2 minutes on 2 CPU cores. Then it writes the model with
`accelerator.save_model` (every rank writes its own rows of the Hugging Face safetensors files, no
gather), reloads the directory on rank 0 with plain `transformers`/`peft` and prints a sample.

`hf_fsdp2.register()` is the only hf_fsdp2-specific line: it routes Accelerate's FSDP2 preparation,
`save_model`, `save_state` and `load_state` through hf_fsdp2. Everything else is ordinary Accelerate.

Common variations:
    ... examples/finetune.py --lora                               # LoRA adapter instead of all weights
    accelerate launch --config_file accelerate_configs/fsdp2_qlora.yaml examples/finetune.py --load-in-4bit
                                                                  # QLoRA: LoRA on a 4-bit base, sharded
    ... examples/finetune.py --model DIR --dataset FILES --lr 2e-5 # a real model and data
    ... examples/finetune.py --save-every 50 --resume auto        # checkpoints; continue after a crash
    accelerate launch --config_file accelerate_configs/fsdp2.yaml --num_processes 1 examples/finetune.py
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
TINY_LLAMA = HERE / "tiny-llama"
BUNDLED_DATA = HERE / "data"
LINEAR_LAYERS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
DATA_BUILDERS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".csv": "csv",
                 ".parquet": "parquet"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", help="a Hugging Face model directory (or hub name); default: the embedded tiny "
                                   "Llama, initialised from examples/tiny-llama/config.json with --seed")
    p.add_argument("--dataset", default=str(BUNDLED_DATA),
                   help="a directory holding train.* and validation.* files, one file, or comma-separated files "
                        "(.txt: one document per line; .json/.jsonl/.csv/.parquet: a --text-column), or a hub "
                        "dataset name")
    p.add_argument("--text-column", default="text")
    p.add_argument("--output-dir", default="outputs/finetune")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--max-steps", type=int, help="optimizer steps; overrides --epochs")
    p.add_argument("--lr", type=float,
                   help="peak learning rate; default 1e-2 (5e-3 with --lora) for the embedded model, else 2e-5 "
                        "(2e-4 with --lora)")
    p.add_argument("--lr-scheduler", default="cosine", choices=["cosine", "linear", "constant"])
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per process per micro-step")
    p.add_argument("--gradient-accumulation-steps", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (documents are packed)")
    p.add_argument("--lora", action="store_true",
                   help="train a LoRA adapter on all linear layers (and `lm_head` of the embedded model)")
    p.add_argument("--load-in-4bit", action="store_true",
                   help="QLoRA (implies --lora): the base loaded by transformers in bitsandbytes NF4 with double "
                        "quantization; prepare() shards the 4-bit weights (needs bitsandbytes: `pip install -e '.[qlora]'` in the checkout)")
    p.add_argument("--fp8", action="store_true",
                   help="FP8 training with FP8 all-gather (torchao float8 on the decoder layers' linears; "
                        "needs torchao: `pip install 'torchao>=0.17'`); same as `mixed_precision: fp8` in the yaml")
    p.add_argument("--auto-layout", action="store_true",
                   help="let hf_fsdp2 pick the cheapest layout that fits memory (register(shard_size='auto'), planned "
                        "for this run's micro-batch); --memory-budget sets the bytes per rank (e.g. 20GB)")
    p.add_argument("--memory-budget", help="with --auto-layout: per-rank budget (default: the device's memory "
                                           "x 0.85, or RAM x 0.75 / local ranks on CPU)")
    p.add_argument("--compile", action="store_true",
                   help="regional compilation: each decoder layer compiled before sharding (register(compile=True))")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--lora-alpha", type=int, help="default: 2 * r")
    p.add_argument("--save-every", type=int, default=0,
                   help="save the training state to OUTPUT_DIR/checkpoints/step-N every N steps and at the end")
    p.add_argument("--save-async", action="store_true",
                   help="checkpoints return once each rank's rows are copied to host memory; writing and the "
                        "atomic commit go on in the background (register(async_save=True))")
    p.add_argument("--resume", help="'auto': continue from the latest complete checkpoint under "
                                    "OUTPUT_DIR/checkpoints (start fresh if none); or a checkpoint directory")
    p.add_argument("--report-to", default="none",
                   help="Accelerate trackers for per-step loss, tokens/s and memory (e.g. tensorboard, wandb, all)")
    p.add_argument("--loss-log", help="a JSON-lines file rank 0 appends {step, loss, lr} to after every step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt", default="the capital of france is")
    p.add_argument("--max-new-tokens", type=int, default=24)
    args = p.parse_args(argv)
    for name in ("epochs", "batch_size", "gradient_accumulation_steps", "seq_len", "lora_r"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.max_steps is not None and args.max_steps < 1:
        p.error(f"--max-steps must be at least 1, got {args.max_steps}")
    if args.save_every < 0:
        p.error(f"--save-every must be >= 0, got {args.save_every}")
    args.lora = args.lora or args.load_in_4bit
    if args.lr is None:  # what suits the embedded model from scratch, or a pretrained one
        args.lr = (5e-3 if args.lora else 1e-2) if args.model is None else (2e-4 if args.lora else 2e-5)
    if args.lora_alpha is None:
        args.lora_alpha = 2 * args.lora_r
    return args


# ---------------------------------------------------------------------------------------------
# Data


def data_files(spec: str) -> tuple[str, dict[str, list[str]]] | None:
    """(builder, {split: files}) for local data, None for a hub dataset name."""
    paths = [Path(s) for s in spec.split(",") if s]
    if len(paths) == 1 and paths[0].is_dir():
        found = {split: sorted(str(f) for f in paths[0].iterdir()
                               if f.name.split(".")[0] == split and f.suffix in DATA_BUILDERS)
                 for split in ("train", "validation")}
        if not found["train"]:
            raise ValueError(f"`--dataset` {spec}: no train.<{'|'.join(s[1:] for s in DATA_BUILDERS)}> file in it.")
        files = {split: fs for split, fs in found.items() if fs}
    elif all(path.is_file() for path in paths):
        files = {"train": [str(path) for path in paths]}
    elif len(paths) == 1 and not paths[0].suffix:
        return None
    else:
        missing = ", ".join(str(path) for path in paths if not path.exists())
        raise ValueError(f"`--dataset` {spec}: no such file or directory: {missing}.")
    builders = {DATA_BUILDERS.get(Path(f).suffix) for fs in files.values() for f in fs}
    if None in builders or len(builders) != 1:
        raise ValueError(f"`--dataset` {spec}: files must all be one of {', '.join(DATA_BUILDERS)}.")
    return builders.pop(), files


def load_splits(args):
    """{"train", "validation"} as packed `input_ids` rows of `--seq-len` tokens."""
    import datasets

    local = data_files(args.dataset)
    raw = datasets.load_dataset(args.dataset) if local is None else datasets.load_dataset(local[0], data_files=local[1])
    if "validation" not in raw:  # hold out 5% of train
        held = raw["train"].train_test_split(test_size=0.05, seed=args.seed)
        raw = datasets.DatasetDict(train=held["train"], validation=held["test"])
    if args.text_column not in raw["train"].column_names:
        raise ValueError(f"`--text-column` {args.text_column!r} is not in the dataset; its columns are "
                         f"{raw['train'].column_names}.")
    return raw


def pack(raw, tokenizer, text_column: str, seq_len: int):
    """Tokenize every document, end it with EOS, concatenate, and cut into `seq_len` rows."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []

    def tokenize(batch):
        return {"ids": [ids + eos for ids in tokenizer(batch[text_column])["input_ids"]]}

    def group(batch):
        flat = [t for ids in batch["ids"] for t in ids]
        end = len(flat) // seq_len * seq_len
        return {"input_ids": [flat[i:i + seq_len] for i in range(0, end, seq_len)]}

    out = {}
    for split, ds in raw.items():
        ds = ds.map(tokenize, batched=True, remove_columns=ds.column_names, desc=f"tokenize {split}")
        ds = ds.map(group, batched=True, batch_size=2000, remove_columns=["ids"], desc=f"pack {split}")
        out[split] = ds.with_format("torch")
    return out


# ---------------------------------------------------------------------------------------------
# Model


def build_model(args):
    """The model every rank starts from (full, unsharded: `accelerator.prepare` shards it)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if args.model is not None:
        # Full fine-tuning keeps fp32 master weights; a frozen LoRA base stays in its stored dtype.
        return AutoModelForCausalLM.from_pretrained(args.model, dtype="auto" if args.lora else torch.float32)
    torch.manual_seed(args.seed)  # the same weights on every rank
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_LLAMA))


def quantization_config(compute_dtype: torch.dtype):
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=compute_dtype)


def load_4bit(directory, compute_dtype: torch.dtype):
    """The base as transformers loads it in 4-bit on every rank; `accelerator.prepare` then keeps 1/N of
    the packed weights per rank. (To never hold the whole 4-bit model: hf_fsdp2.from_pretrained with
    `quantization_config` and `peft_config`, each rank quantizing only its own rows.)"""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, quantization_config=quantization_config(compute_dtype),
                                                device_map="cpu" if not torch.cuda.is_available() else None,
                                                dtype="auto")


def add_lora(model, args):
    from peft import LoraConfig, get_peft_model

    # A pretrained model's output layer is usually left alone; the embedded model's is random, and
    # its logits stay too flat to learn anything unless `lm_head` adapts as well.
    targets = "all-linear" if args.model is not None else [*LINEAR_LAYERS, "lm_head"]
    config = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, target_modules=targets, lora_dropout=0.0,
                        task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def memory_gb(device: torch.device) -> float:
    """Peak CUDA memory allocated by this process, or its peak resident memory on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class Progress:
    """Optimizer steps taken; saved and restored with the training state (`register_for_checkpointing`)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


@torch.no_grad()
def evaluate(accelerator, model, loader) -> float:
    """Mean per-token loss over the whole validation split (duplicates from uneven sharding dropped)."""
    model.eval()
    losses = []
    for batch in loader:
        ids = batch["input_ids"]
        logits = model(input_ids=ids).logits.float()
        per_row = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
        losses.append(accelerator.gather_for_metrics(per_row.view(ids.shape[0], -1).mean(1)))
    model.train()
    return torch.cat(losses).mean().item()


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)

    import datasets
    import transformers
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed
    from torch.utils.data import DataLoader
    from tqdm.auto import tqdm

    import hf_fsdp2
    from hf_fsdp2.checkpoint.state import latest_state, list_states

    output_dir = Path(args.output_dir).absolute()
    checkpoints = output_dir / "checkpoints"
    if args.resume is None and list_states(checkpoints):
        raise SystemExit(f"{checkpoints} holds checkpoints of an earlier run: pass `--resume auto` to continue it, "
                         "or choose another `--output-dir`.")

    # Accelerate's FSDP2 paths now shard, save and resume with hf_fsdp2.
    options = {"async_save": args.save_async, "fp8": args.fp8, "compile": args.compile}
    if args.auto_layout:
        options.update(shard_size="auto", plan_batch_size=args.batch_size, plan_seq_len=args.seq_len,
                       memory_budget=args.memory_budget)
    elif args.memory_budget:
        raise SystemExit("--memory-budget is the budget of --auto-layout; add --auto-layout.")
    hf_fsdp2.register(**{k: v for k, v in options.items() if v not in (False, None)})
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        log_with=None if args.report_to == "none" else args.report_to.split(","),
        project_config=ProjectConfiguration(project_dir=str(output_dir), logging_dir=str(output_dir / "logs")),
        # The shuffle order depends only on (seed, epoch), so a resumed run sees the same batches.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        # The schedule advances once per optimizer step, whatever the number of processes.
        step_scheduler_with_optimizer=False,
    )
    if not accelerator.is_main_process:  # one voice: rank 0 prints, logs and draws the progress bar
        transformers.logging.set_verbosity_error()
        datasets.logging.set_verbosity_error()
        datasets.disable_progress_bars()
        warnings.simplefilter("ignore")
    set_seed(args.seed)

    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model or TINY_LLAMA)
    with accelerator.main_process_first():  # rank 0 fills the datasets cache, the others read it
        splits = pack(load_splits(args), tokenizer, args.text_column, args.seq_len)
    world = accelerator.num_processes
    if len(splits["train"]) < args.batch_size * world:
        raise SystemExit(f"the training data packs into {len(splits['train'])} sequences of {args.seq_len} tokens, "
                         f"fewer than one batch ({args.batch_size} x {world} processes): lower `--batch-size` "
                         "or `--seq-len`.")

    model = build_model(args)
    base_dir = None
    if args.lora:
        if args.model is None:
            # The embedded model's random weights exist nowhere else: keep a copy of the (tiny, unsharded)
            # base, so that the adapter's `base_model_name_or_path` names real weights.
            base_dir = output_dir / "base-model"
            if accelerator.is_main_process:
                model.save_pretrained(base_dir)
                tokenizer.save_pretrained(base_dir)
            model.name_or_path = str(base_dir)
        if args.load_in_4bit:
            accelerator.wait_for_everyone()  # rank 0 has written base-model/
            compute = torch.bfloat16 if accelerator.mixed_precision == "bf16" else torch.float32
            if torch.cuda.is_available():  # bitsandbytes quantizes on the device it loads to
                model = load_4bit(base_dir or args.model, compute).to(accelerator.device)
            else:
                model = load_4bit(base_dir or args.model, compute)
        model = add_lora(model, args)
    trainable = [p for p in model.parameters() if p.requires_grad]
    # fused: one kernel per step for all parameters (the Trainer's default, adamw_torch_fused). The
    # default per-parameter loop dispatches every op through DTensor: ~8x slower steps on CPU shards.
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95),
                                  fused=True)
    train_loader = DataLoader(splits["train"], batch_size=args.batch_size, shuffle=True, drop_last=True)
    eval_loader = DataLoader(splits["validation"], batch_size=args.batch_size)

    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
    steps_per_epoch = math.ceil(len(train_loader) / args.gradient_accumulation_steps)  # per-process batches
    total_steps = args.max_steps or args.epochs * steps_per_epoch
    scheduler = transformers.get_scheduler(
        {"constant": "constant_with_warmup"}.get(args.lr_scheduler, args.lr_scheduler), optimizer,
        num_warmup_steps=min(args.warmup_steps, total_steps // 10), num_training_steps=total_steps)
    scheduler = accelerator.prepare(scheduler)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)

    if args.resume is not None:
        resume_from = latest_state(checkpoints) if args.resume == "auto" else Path(args.resume)
        if resume_from is not None:
            accelerator.load_state(resume_from)  # model, optimizer, scheduler, RNG, `progress`: on any world size
            accelerator.print(f"resumed from {resume_from} at step {progress.step}")
        else:
            accelerator.print(f"no complete checkpoint under {checkpoints}: starting fresh")
    accelerator.init_trackers("finetune", config={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()})

    n_params = sum(p.numel() for p in model.parameters())  # DTensor.numel() is the global size
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    accelerator.print(
        f"{'LoRA' if args.lora else 'full'} fine-tune of {args.model or 'the embedded tiny Llama'} on {world} "
        f"{accelerator.device.type} process(es), {accelerator.distributed_type}: "
        f"{len(splits['train'])} x {args.seq_len}-token sequences, {total_steps} steps of "
        f"{args.batch_size * world * args.gradient_accumulation_steps} sequences, lr {args.lr:g}; "
        f"{n_params:,} parameters, {n_trainable:,} trainable")
    initial_eval = evaluate(accelerator, model, eval_loader)

    tokens_per_step = args.batch_size * args.seq_len * args.gradient_accumulation_steps * world
    step, loss = progress.step, None
    epoch, skip = divmod(step, steps_per_epoch)
    skip *= args.gradient_accumulation_steps
    bar = tqdm(total=total_steps, initial=step, desc="train", unit="step", disable=not accelerator.is_main_process)
    model.train()
    tic, train_seconds, steps_timed = time.perf_counter(), 0.0, 0
    while step < total_steps:
        # After a resume, skip what the interrupted run already consumed of this epoch.
        loader = accelerator.skip_first_batches(train_loader, skip) if skip else train_loader
        loader.set_epoch(epoch)
        micro_losses = []
        for batch in loader:
            with accelerator.accumulate(model):
                out = model(input_ids=batch["input_ids"], labels=batch["input_ids"])
                accelerator.backward(out.loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()
            micro_losses.append(out.loss.detach())
            if not accelerator.sync_gradients:
                continue
            lr = scheduler.get_last_lr()[0]  # the rate this step used
            scheduler.step()
            step += 1
            progress.step = step
            loss = accelerator.reduce(torch.stack(micro_losses).mean(), reduction="mean").item()
            micro_losses = []
            toc = time.perf_counter()
            tokens_per_s = tokens_per_step / (toc - tic)
            train_seconds, steps_timed, tic = train_seconds + toc - tic, steps_timed + 1, toc
            bar.update(1)  # the bar shows the average rate so far (checkpoint saves excluded)
            bar.set_postfix(loss=f"{loss:.4f}", tokens_per_s=f"{tokens_per_step * steps_timed / train_seconds:,.0f}")
            if args.loss_log and accelerator.is_main_process:
                with open(args.loss_log, "a") as log:
                    log.write(json.dumps({"step": step, "loss": loss, "lr": lr}) + "\n")
            accelerator.log({"train/loss": loss, "train/lr": lr,
                             "train/tokens_per_s": tokens_per_s, "train/memory_gb": memory_gb(accelerator.device),
                             "train/epoch": epoch}, step=step)
            if args.save_every and (step % args.save_every == 0 or step == total_steps):
                accelerator.save_state(checkpoints / f"step-{step}")
                tic = time.perf_counter()
            if step >= total_steps:
                break
        epoch, skip = epoch + 1, 0
    bar.close()

    final_eval = evaluate(accelerator, model, eval_loader)
    accelerator.log({"eval/loss": final_eval}, step=step)
    accelerator.print(f"validation loss {initial_eval:.4f} -> {final_eval:.4f}")
    if loss is not None:
        accelerator.print(f"final train loss {loss:.6f} at step {step}")
    kind = "CUDA memory allocated" if accelerator.device.type == "cuda" else "resident memory"
    accelerator.print(f"peak {kind} of rank 0: {memory_gb(accelerator.device):.2f} GB")

    # Every rank writes its own rows of the Hugging Face files: no gather to rank 0. (An adapted
    # `lm_head` brings its frozen base weight into the adapter, as with PEFT's own save, which says so.)
    warnings.filterwarnings("ignore", message="Setting `save_embedding_layers` to `True`")
    accelerator.save_model(model, output_dir)
    if accelerator.is_main_process:
        tokenizer.save_pretrained(output_dir)
        accelerator.print(f"saved the {'adapter' if args.lora else 'model'} to {output_dir}")
        sample(args, output_dir, base_dir, tokenizer, accelerator.device)
    accelerator.wait_for_everyone()
    accelerator.end_training()


def sample(args, output_dir: Path, base_dir: Path | None, tokenizer, device: torch.device) -> None:
    """Reload what was saved with plain transformers / peft (one process, no hf_fsdp2) and generate."""
    from transformers import AutoModelForCausalLM

    if args.lora:
        from peft import PeftModel

        base = (load_4bit(base_dir or args.model, torch.float32) if args.load_in_4bit
                else AutoModelForCausalLM.from_pretrained(base_dir or args.model))
        model = PeftModel.from_pretrained(base, output_dir)
    else:
        model = AutoModelForCausalLM.from_pretrained(output_dir)
    model.to(device).eval()
    # return_token_type_ids=False: transformers 4.x tokenizers add them and Llama's generate() refuses them.
    inputs = tokenizer(args.prompt, return_tensors="pt", return_token_type_ids=False).to(device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with torch.no_grad():
        ids = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=pad)
    print(f"sample: {tokenizer.decode(ids[0], skip_special_tokens=True)}", flush=True)


if __name__ == "__main__":
    main()
