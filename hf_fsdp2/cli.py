"""`hf-fsdp2`: command-line tools. One subcommand per `_add_<name>` function, each with its own handler.

Handlers import their module lazily (the package itself, and so torch, is imported by any command).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-fsdp2", description="PyTorch FSDP2 tools for Hugging Face models.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_convert(commands)
    _add_check_config(commands)
    _add_estimate_memory(commands)
    _add_simulate(commands)
    _add_plan(commands)
    _add_config_file(commands)
    _add_config(commands)
    _add_run(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except (ValueError, OSError) as e:  # bad input or I/O: the message names the path; no traceback
        print(f"hf-fsdp2 {args.command}: error: {e}", file=sys.stderr)
        return 1


# ---------------------------------------------------------------------------------------------
# config-file


SHIPPED_CONFIGS = Path(__file__).resolve().parent / "configs"  # accelerate_configs/ in a checkout links here


def _add_config_file(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "config-file",
        help="Print the path of an Accelerate config shipped with hf_fsdp2 (for accelerate launch --config_file).",
        description="The Accelerate configs in the package (the checkout's accelerate_configs/): "
                    "accelerate launch --config_file \"$(hf-fsdp2 config-file fsdp2.yaml)\" train.py. Copy one to "
                    "edit it (e.g. fsdp_transformer_layer_cls_to_wrap for a model other than Llama).",
    )
    p.add_argument("name", help="one of the shipped files, e.g. fsdp2.yaml")
    p.set_defaults(handler=_run_config_file)


def _run_config_file(args: argparse.Namespace) -> int:
    # Listed here, not when the parser is built: every other command would pay for it.
    names = sorted(p.name for p in SHIPPED_CONFIGS.iterdir() if p.suffix in (".yaml", ".json"))
    if args.name not in names:
        raise ValueError(f"`name`={args.name!r} is not a shipped config; choose from {', '.join(names)}.")
    print(SHIPPED_CONFIGS / args.name)
    return 0


def _add_config(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "config",
        help="Write an Accelerate config for a model: its decoder layer class, processes, precision, EP, budget.",
        description="A shipped config (--template) with the model's own decoder layer class (its _no_split_modules, "
                    "read on the meta device from MODEL's config.json), --num-processes (and a TP/CP config's "
                    "data-parallel size) and --mixed-precision set, every comment kept; checked by check-config "
                    "before it is written. Expert parallelism and the auto layout's memory budget, which Accelerate's "
                    "yaml cannot carry, are written as the HF_FSDP2_* variables the launch needs. "
                    "hf_fsdp2/tools/config_writer.py.",
    )
    p.add_argument("model", help="a model directory or its config.json (local)")
    p.add_argument("--template", default="fsdp2", help="fsdp2 (default), fsdp2_lora, fsdp2_qlora, fsdp2_tp, "
                                                       "fsdp2_cp or hsdp: the shipped config to start from")
    p.add_argument("--num-processes", type=_positive_int, default=None, help="ranks (default: the template's)")
    p.add_argument("--mixed-precision", default=None, help="no, bf16 or fp16 (default: the template's)")
    p.add_argument("--ep-size", type=_positive_int, default=1, metavar="E",
                   help="expert parallelism for a MoE model (written as HF_FSDP2_EP_SIZE=E for the launch)")
    p.add_argument("--sp-size", type=_positive_int, default=1, metavar="S",
                   help="Ulysses sequence parallelism, long sequences (written as HF_FSDP2_SP_SIZE=S for the launch: "
                        "the prepared data loader and model split every sequence over S ranks)")
    p.add_argument("--cp-size", type=_positive_int, default=1, metavar="C",
                   help="with --sp-size: ring context parallelism around Ulysses, every sequence over S x C ranks "
                        "(written as HF_FSDP2_CP_SIZE=C for the launch; Accelerate's own CP is the fsdp2_cp template)")
    p.add_argument("--memory-budget", default=None, metavar="SIZE",
                   help="per-rank bytes (e.g. 20GiB) the auto layout must fit (written as HF_FSDP2_SHARD_SIZE=auto "
                        "HF_FSDP2_MEMORY_BUDGET=SIZE for the launch)")
    p.add_argument("-o", "--output", default=None,
                   help="file to write (default: print it); refused if it exists (unless --overwrite) or lies inside "
                        "hf_fsdp2's own folder (a checkout's accelerate_configs/); written whole or not at all, a "
                        "symlink replaced by the file (its target untouched)")
    p.add_argument("--overwrite", action="store_true", help="replace OUTPUT if it exists")
    p.set_defaults(handler=_run_config)


def _run_config(args: argparse.Namespace) -> int:
    from .tools.config_writer import write_config, write_file

    model = Path(args.model)
    if not (model / "config.json" if model.is_dir() else model).is_file():
        raise ValueError(f"`model`={args.model!r}: no config.json there (a local model directory or its config.json).")
    text = write_config(model, template=args.template, num_processes=args.num_processes,
                        mixed_precision=args.mixed_precision, ep_size=args.ep_size,
                        memory_budget=args.memory_budget, sp_size=args.sp_size, cp_size=args.cp_size)
    if args.output is None:
        print(text, end="")
    else:
        write_file(args.output, text, overwrite=args.overwrite)
        print(f"{args.output}: written, OK for hf_fsdp2 (check-config)", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------------
# run

STARTUP = Path(__file__).resolve().parent / "startup"  # sitecustomize.py: register() once Accelerate/the Trainer load


def _add_run(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "run",
        help="Run a command whose code you do not edit with hf_fsdp2 registered in every Python process it starts.",
        description="hf-fsdp2 run COMMAND [ARGS ...]: e.g. hf-fsdp2 run accelerate launch --config_file "
                    "\"$(hf-fsdp2 config-file fsdp2.yaml)\" train.py, or hf-fsdp2 run llamafactory-cli train cfg.yaml. "
                    "Sets HF_FSDP2=1 and puts hf_fsdp2's start-up folder first on PYTHONPATH, so each Python "
                    "process (the launcher, its workers) calls hf_fsdp2.register() once it imports Accelerate or "
                    "the Transformers Trainer, before the command's code uses them; said on rank 0. Processes "
                    "that import neither (pip, python -c ...) do not load hf_fsdp2. Python started with -I, -E or "
                    "-S ignores PYTHONPATH or site: hf_fsdp2 is off in such a process (a warning when COMMAND is "
                    "one). The command replaces this process (exec): signals reach it and its exit status is the "
                    "shell's (143 after SIGTERM, 130 after Ctrl-C). Nothing changes for commands not run this way.",
    )
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="COMMAND [ARGS ...]")
    p.set_defaults(handler=_run_run)


def _run_run(args: argparse.Namespace) -> int:
    """Never returns but on error: the command is exec'd in this process, so there is no wrapper between it and
    the shell or scheduler (a child process would need every signal forwarded and its status translated)."""
    import os
    import shutil
    import signal

    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        raise ValueError("`COMMAND` is missing: hf-fsdp2 run accelerate launch ... train.py")
    if shutil.which(cmd[0]) is None:
        print(f"hf-fsdp2 run: error: `COMMAND` {cmd[0]!r} is not found on PATH.", file=sys.stderr)
        return 127  # a shell's status for a command not found
    if _python_without_pythonpath(cmd):
        print(f"hf-fsdp2 run: warning: {' '.join(cmd[:2])} ...: Python's -I, -E and -S ignore PYTHONPATH or "
              "site, so hf_fsdp2 is not registered in that process (drop the flag, or call "
              "hf_fsdp2.register() in the script).", file=sys.stderr)
    env = dict(os.environ, HF_FSDP2="1",
               PYTHONPATH=os.pathsep.join([str(STARTUP), *filter(None, [os.environ.get("PYTHONPATH")])]))
    sys.stdout.flush()
    sys.stderr.flush()
    for name in ("SIGPIPE", "SIGXFSZ"):  # Python ignores these, and exec keeps what is ignored: restore as a shell
        if hasattr(signal, name):  # would have them (subprocess's restore_signals does the same)
            signal.signal(getattr(signal, name), signal.SIG_DFL)
    try:
        os.execvpe(cmd[0], cmd, env)
    except OSError as e:
        print(f"hf-fsdp2 run: error: cannot execute {cmd[0]!r}: {e}", file=sys.stderr)
        return 126  # a shell's status for a command found but not executable


def _python_without_pythonpath(cmd: Sequence[str]) -> bool:
    """`python -I/-E/-S ...` (python3.11 too): one of them among the options before the script, -c or -m."""
    import re

    if not re.fullmatch(r"python[0-9.]*", Path(cmd[0]).name):
        return False
    args = iter(cmd[1:])
    for arg in args:
        if not arg.startswith("-") or arg in ("-", "--") or arg.startswith("--"):
            return False  # the script, stdin, or a long option: no more short options to read
        for i, letter in enumerate(arg[1:], start=2):
            if letter in "IES":
                return True
            if letter in "cm":  # what follows is the code or the module
                return False
            if letter in "WX":  # what follows is its value, here or in the next argument
                if i == len(arg):
                    next(args, None)
                break
    return False


# ---------------------------------------------------------------------------------------------
# convert


def _add_convert(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "convert",
        help="Accelerate SHARDED_STATE_DICT (torch DCP) checkpoint -> Hugging Face safetensors, streaming.",
        description="Convert the DCP checkpoint Accelerate writes with `fsdp_state_dict_type: SHARDED_STATE_DICT` "
                    "(the `pytorch_model_fsdp_0` directory, or the checkpoint directory holding it) into a Hugging "
                    "Face safetensors directory, one tensor in memory at a time.",
    )
    p.add_argument("src", help="the `pytorch_model_fsdp_0` directory, or the checkpoint directory holding it")
    p.add_argument("dst", help="output directory; must be absent or empty unless --overwrite")
    p.add_argument("--max-shard-size", default="5GB",
                   help="split the weights into files of at most this size (e.g. 5GB, 500MiB; default 5GB)")
    p.add_argument("--dtype", default=None, metavar="{bf16,fp16,fp32}",
                   help="cast floating-point tensors to this dtype (default: keep the saved dtype)")
    p.add_argument("--config", default=None, metavar="DIR", dest="config_dir",
                   help="directory with config.json / generation_config.json (default: SRC or its parent)")
    p.add_argument("--overwrite", action="store_true", help="replace DST if it exists and is not empty")
    p.set_defaults(handler=_run_convert)


def _run_convert(args: argparse.Namespace) -> int:
    from .checkpoint.convert import convert_dcp_to_safetensors

    result = convert_dcp_to_safetensors(args.src, args.dst, max_shard_size=args.max_shard_size, dtype=args.dtype,
                                        config_dir=args.config_dir, overwrite=args.overwrite)
    print(f"wrote {result.num_tensors} tensors ({result.total_bytes / 1e6:.1f} MB) to {result.dst}: "
          f"{', '.join(result.files)}")
    if result.config_source is None:
        print("note: no config.json found next to SRC; copy the model's config.json into DST "
              "(or pass --config DIR) before loading it with from_pretrained.", file=sys.stderr)
    else:
        print(f"config from {result.config_source}")
    return 0


# ---------------------------------------------------------------------------------------------
# check-config


def _add_check_config(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "check-config",
        help="Check an Accelerate config file for use with hf_fsdp2.",
        description="Report what Accelerate would silently drop or mangle in an Accelerate config file (yaml, or "
                    "json), and what hf_fsdp2 cannot honour. Launches nothing. Exit status: 0 when there are no "
                    "errors (warnings allowed), 1 when there are errors, 2 when a file cannot be read.",
    )
    p.add_argument("files", nargs="+", metavar="FILE", help="Accelerate config file(s), e.g. accelerate_configs/*.yaml")
    p.set_defaults(handler=_run_check_config)


def _run_check_config(args: argparse.Namespace) -> int:
    from .tools.check_config import ConfigFileError, check_accelerate_config, render

    status = 0
    for path in args.files:
        try:
            findings = check_accelerate_config(path)
        except ConfigFileError as e:
            print(f"hf-fsdp2 check-config: error: {e}", file=sys.stderr)
            status = 2
            continue
        print(render(path, findings))
        if any(f.level == "error" for f in findings):
            status = max(status, 1)
    return status


# ---------------------------------------------------------------------------------------------
# estimate-memory


MAX_WORLD_SIZE = 1 << 20  # far above any cluster; bounds the work of planning for a typo


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _world_size(text: str) -> int:
    value = _positive_int(text)
    if value > MAX_WORLD_SIZE:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_WORLD_SIZE} ranks, got {text!r}")
    return value


def _hsdp_shape(text: str) -> tuple[int, int]:
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"must be RxS (replicas x shard size), e.g. 2x4; got {text!r}")
    return int(parts[0]), int(parts[1])


def _add_model_setup(p: argparse.ArgumentParser) -> None:
    """The model and training setup `estimate-memory` and `plan` both cost."""
    p.add_argument("--model", required=True, metavar="CONFIG_OR_DIR",
                   help="a model directory with config.json, or a config.json file")
    p.add_argument("--world-size", required=True, type=_world_size, metavar="N", help="number of ranks")
    p.add_argument("--dtype", default="fp32", metavar="{fp32,bf16,fp16}",
                   help="dtype the parameters are stored (sharded) in; default fp32, the config's dtype is ignored")
    p.add_argument("--param-dtype", default=None, metavar="{bf16,fp16,fp32}",
                   help="MixedPrecisionPolicy param_dtype: all-gather and compute dtype (default: the storage dtype)")
    p.add_argument("--reduce-dtype", default="fp32", metavar="{fp32,bf16,fp16}",
                   help="MixedPrecisionPolicy reduce_dtype for gradient reduce-scatter (default fp32)")
    p.add_argument("--frozen-dtype", default=None, metavar="{bf16,fp16,fp32}",
                   help="store frozen (non-trainable) parameters in this dtype, e.g. bf16 base weights under LoRA")
    p.add_argument("--lora-r", type=_positive_int, default=None, metavar="R",
                   help="add peft LoRA of rank R: only the adapters are trainable")
    p.add_argument("--lora-targets", default="q_proj,v_proj", metavar="NAMES",
                   help="comma-separated module names LoRA adapts (default q_proj,v_proj)")
    p.add_argument("--load-in-4bit", action="store_true",
                   help="QLoRA: a bitsandbytes 4-bit (NF4) base, quantized from --dtype, as hf_fsdp2.from_pretrained("
                        "quantization_config=BitsAndBytesConfig(load_in_4bit=True)) shards it; needs --lora-r")
    p.add_argument("--double-quant", action="store_true",
                   help="with --load-in-4bit: bnb_4bit_use_double_quant (8-bit absmax codes)")
    p.add_argument("--fp8", action="store_true",
                   help="FP8 training with FP8 all-gather (FSDP2Config.fp8): decoder-layer linears gathered in float8")
    p.add_argument("--batch-size", type=_positive_int, default=1, help="sequences per rank per step (default 1)")
    p.add_argument("--seq-len", type=_positive_int, default=2048, help="tokens per sequence (default 2048)")
    p.add_argument("--json", action="store_true", help="print the result as JSON (bytes) instead of a table")


def _model_setup(args: argparse.Namespace, **layout) -> tuple[object, dict]:
    """(FSDP2Config, estimate_memory keyword arguments) from `_add_model_setup`'s flags."""
    from .config import FSDP2Config, parse_dtype

    dtypes = {}
    for flag in ("dtype", "param_dtype", "reduce_dtype", "frozen_dtype"):
        try:
            dtypes[flag] = parse_dtype(getattr(args, flag), flag)
        except (TypeError, ValueError) as e:
            raise ValueError(f"`--{flag.replace('_', '-')}`: {e}") from None
    targets = [t.strip() for t in args.lora_targets.split(",") if t.strip()]
    if args.lora_r is not None and not targets:
        raise ValueError("`--lora-targets` is empty; name the modules to adapt, e.g. q_proj,v_proj.")
    if args.double_quant and not args.load_in_4bit:
        raise ValueError("`--double-quant` applies to 4-bit weights: add `--load-in-4bit`.")
    if args.load_in_4bit:
        if args.lora_r is None:
            raise ValueError("`--load-in-4bit` freezes the quantized base weights, so there is nothing to train "
                             "without LoRA: add `--lora-r R` (and `--lora-targets`).")
        from transformers import BitsAndBytesConfig

        from .quantization import quantized

        try:
            quantized.check_available(BitsAndBytesConfig(load_in_4bit=True))
        except ImportError as e:
            raise ValueError(f"`--load-in-4bit`: {e}") from None
    config = FSDP2Config(param_dtype=dtypes["param_dtype"], reduce_dtype=dtypes["reduce_dtype"],
                         frozen_dtype=dtypes["frozen_dtype"], fp8=args.fp8, **layout)
    return config, dict(dtype=dtypes["dtype"], lora_r=args.lora_r, lora_targets=targets,
                        load_in_4bit=args.load_in_4bit, bnb_4bit_use_double_quant=args.double_quant)


def _flag_names(e: ValueError) -> ValueError:
    """The library names its arguments; say which flag they came from."""
    message = str(e)
    for name, flag in (("model", "--model"), ("lora_targets", "--lora-targets"), ("lora_r", "--lora-r"),
                       ("tp_size", "--tp-size"), ("cp_size", "--cp-size"), ("ep_size", "--ep-size"),
                       ("sp_size", "--sp-size"), ("loss_tile_size", "--loss-tile-size"),
                       ("mlp_tile_size", "--mlp-tile-size"),
                       ("seq_len", "--seq-len"),
                       ("load_in_4bit", "--load-in-4bit"), ("bnb_4bit_use_double_quant", "--double-quant"),
                       ("gradient_accumulation_steps", "--gradient-accumulation-steps")):
        message = message.replace(f"`{name}`", f"`{flag}`")
    return ValueError(message)


def _add_estimate_memory(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "estimate-memory",
        help="Per-rank memory of training a model with hf_fsdp2 (FSDP2 + AdamW), from its config alone.",
        description="Build the model on the meta device from its config, shard it on paper exactly as shard_model "
                    "would (torch.chunk rows per rank), and report per-rank bytes for parameters, gradients, AdamW "
                    "states, the all-gather and reduce-scatter transients and activations. Sharded parameters, "
                    "gradients and AdamW moments are in the storage dtype (--dtype, fp32 master weights by "
                    "default); --param-dtype is the dtype groups are all-gathered and computed in. The accounting "
                    "is described in hf_fsdp2/planner/memory.py.",
    )
    _add_model_setup(p)
    _add_layout_flags(p)
    p.set_defaults(handler=_run_estimate_memory)


def _add_layout_flags(p: argparse.ArgumentParser) -> None:
    """The layout `estimate-memory` costs and `simulate` runs."""
    p.add_argument("--hsdp", type=_hsdp_shape, default=None, metavar="RxS",
                   help="HSDP: R replicas, each sharding over S ranks (R*S must equal --world-size)")
    p.add_argument("--offload", action="store_true",
                   help="CPUOffloadPolicy: sharded params, grads and optimizer states in CPU memory")
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute each decoder layer in backward")
    p.add_argument("--checkpoint-every", type=int, default=1, metavar="K",
                   help="with --activation-checkpointing: checkpoint every K-th decoder layer (default 1: every layer)")
    p.add_argument("--checkpoint-save-matmuls", action="store_true",
                   help="with --activation-checkpointing: op-level selective checkpointing (keep matmul and attention "
                        "outputs, recompute the cheap ops)")
    p.add_argument("--tp-size", type=_positive_int, default=1, metavar="T",
                   help="tensor parallelism over T ranks with the model's own TP plan; FSDP shards each rank's block "
                        "over the other ranks (--world-size / T, or the S of --hsdp)")
    p.add_argument("--cp-size", type=_positive_int, default=1, metavar="C",
                   help="context parallelism: C of the shard ranks split every sequence (each holds --seq-len / C "
                        "tokens)")
    p.add_argument("--sp-size", type=_positive_int, default=1, metavar="S",
                   help="Ulysses sequence parallelism: S neighbouring shard ranks each hold --seq-len / S tokens of "
                        "every sequence, attention by heads after an all-to-all (FSDP2Config.sp_size)")
    p.add_argument("--loss-tile-size", type=_positive_int, default=None, metavar="N",
                   help="sequence tiling: the head and loss computed N tokens at a time (FSDP2Config.loss_tile_size)")
    p.add_argument("--mlp-tile-size", type=_positive_int, default=None, metavar="N",
                   help="sequence tiling: each MLP computed N tokens at a time (FSDP2Config.mlp_tile_size)")
    p.add_argument("--gradient-accumulation-steps", type=_positive_int, default=1, metavar="G",
                   help="micro-batches per optimizer step; above 1 the gradients stay alive through forward "
                        "(default 1)")
    p.add_argument("--ep-size", type=_positive_int, default=1, metavar="E",
                   help="expert parallelism (MoE models): each layer's experts split over E of the shard ranks with "
                        "the model's own EP plan, FSDP-sharded over the shard size / E ranks holding the same ones")


def _layout_setup(args: argparse.Namespace, **extra) -> tuple[object, dict]:
    """(FSDP2Config, estimate_memory keyword arguments) from `_add_model_setup`'s and `_add_layout_flags`' flags."""
    replicate, shard = args.hsdp or (1, None)
    if args.world_size % args.tp_size:
        raise ValueError(f"`--tp-size` {args.tp_size} does not divide `--world-size` {args.world_size}.")
    if args.hsdp and replicate * shard * args.tp_size != args.world_size:
        raise ValueError(f"`--hsdp` {replicate}x{shard} x `--tp-size` {args.tp_size} covers "
                         f"{replicate * shard * args.tp_size} ranks but `--world-size` is {args.world_size}; "
                         "R*S*T must equal the world size.")
    layout = {"replicate_size": replicate, "shard_size": shard, **extra}  # simulate's auto layout replaces the shard size
    return _model_setup(args, cpu_offload=args.offload, activation_checkpointing=args.activation_checkpointing,
                        checkpoint_every=args.checkpoint_every, checkpoint_save_matmuls=args.checkpoint_save_matmuls,
                        tp_size=args.tp_size, ep_size=args.ep_size, sp_size=args.sp_size,
                        loss_tile_size=args.loss_tile_size, mlp_tile_size=args.mlp_tile_size, **layout)


def _run_estimate_memory(args: argparse.Namespace) -> int:
    from .planner.memory import estimate_memory

    config, setup = _layout_setup(args)
    try:
        estimate = estimate_memory(args.model, args.world_size, config, batch_size=args.batch_size,
                                   seq_len=args.seq_len, cp_size=args.cp_size,
                                   gradient_accumulation_steps=args.gradient_accumulation_steps, **setup)
    except ValueError as e:
        raise _flag_names(e) from None
    print(estimate.to_json(indent=2) if args.json else estimate.format_table())
    return 0


# ---------------------------------------------------------------------------------------------
# simulate


def _add_simulate(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "simulate",
        help="Run one rank of an N-rank job in this process (torch's fake process group): its real memory and "
             "compute, the bytes its collectives would move, and a predicted step time.",
        description="Each --rank (default the first and the last) runs in a process of its own as that rank of "
                    "--world-size under torch's fake process group: collectives move nothing, every tensor has its "
                    "real per-rank shape. The model is built from its config on the meta device and sharded by "
                    "shard_model, so only the rank's rows are allocated (random weights); --steps AdamW steps on "
                    "random tokens run on this machine's device (CUDA when present). Reported per rank: CUDA "
                    "allocated/reserved peaks, RSS and glibc heap peaks, the step's compute time, the estimate for "
                    "the same setup and the ratio; the collectives of one step with their bytes; and a PREDICTED "
                    "step time and tokens/s per GPU for the interconnect given (assumptions printed). "
                    "hf_fsdp2/tools/simulate.py.",
    )
    _add_model_setup(p)
    _add_layout_flags(p)
    p.add_argument("--rank", type=int, action="append", default=None, metavar="R",
                   help="a rank to simulate (repeat for several; default: 0 and world size - 1)")
    p.add_argument("--steps", type=_positive_int, default=3, help="optimizer steps (default 3): those between the first (optimizer states allocated) and the last "
                        "(collectives tallied) are timed, as far as there are any")
    p.add_argument("--memory-budget", default=None, metavar="SIZE",
                   help="shard_size='auto' with this budget per rank (e.g. 80GB): the layout the planner picks")
    p.add_argument("--replication", choices=("ddp", "fsdp2"), default=None,
                   help="how one-rank shard groups train (FSDP2Config.replication); DDP's reducer (the default) cannot "
                        "run under the fake group and is refused by name")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when present, else cpu")
    p.add_argument("--intra-node-gbps", type=float, default=None, metavar="GB/s",
                   help="bus bandwidth inside a node, for the prediction (default 360: an assumption, printed)")
    p.add_argument("--inter-node-gbps", type=float, default=None, metavar="GB/s",
                   help="bus bandwidth per GPU across nodes, for the prediction (default 40: an assumption, printed)")
    p.add_argument("--latency-us", type=float, default=None, help="per collective, for the prediction (default 15)")
    p.add_argument("--gpus-per-node", type=_positive_int, default=None, help="for the prediction (default 8)")
    p.set_defaults(handler=_run_simulate)


def _run_simulate(args: argparse.Namespace) -> int:
    import json

    from .planner import step_time
    from .tools.simulate import format_reports, simulate_ranks

    extra = {}
    if args.memory_budget is not None:
        if args.hsdp:
            raise ValueError("`--memory-budget` lets the planner pick the replicas and shards; drop `--hsdp`.")
        extra = dict(shard_size="auto", memory_budget=args.memory_budget, plan_batch_size=args.batch_size,
                     plan_seq_len=args.seq_len)
    if args.replication is not None:
        extra["replication"] = args.replication
    if args.cp_size > 1:  # simulate builds the "cp" mesh dimension as Accelerate would (tools/simulate.py)
        extra["cp_size"] = args.cp_size
    config, setup = _layout_setup(args, **extra)
    ranks = args.rank if args.rank is not None else sorted({0, args.world_size - 1})
    bad = [r for r in ranks if not 0 <= r < args.world_size]
    if bad:
        raise ValueError(f"`--rank` {bad[0]} must be from 0 to `--world-size` - 1 = {args.world_size - 1}.")
    given = {k: v for k, v in (("intra_node_gbps", args.intra_node_gbps), ("inter_node_gbps", args.inter_node_gbps),
                               ("latency_us", args.latency_us), ("gpus_per_node", args.gpus_per_node)) if v is not None}
    link = step_time.Interconnect(**given, **({"source": "given on the command line: " + ", ".join(
        f"{k}={v}" for k, v in given.items()) + "; the rest: " + step_time.DEFAULT_SOURCES} if given else {}))
    try:
        reports = simulate_ranks(ranks, args.model, args.world_size, config, batch_size=args.batch_size,
                                 seq_len=args.seq_len, steps=args.steps, interconnect=link, device=args.device,
                                 gradient_accumulation_steps=args.gradient_accumulation_steps, **setup)
    except ValueError as e:
        raise _flag_names(e) from None
    print(json.dumps([r.to_dict() for r in reports], indent=2) if args.json else format_reports(reports))
    return 0


# ---------------------------------------------------------------------------------------------
# plan


def _add_plan(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "plan",
        help="The layout shard_size='auto' picks: the cheapest that fits a memory budget per rank.",
        description="Cost every layout (shard size S dividing the world size, reshard_after_forward, activation "
                    "checkpointing, sequence tiling of the loss and MLPs when a rank holds more than 1024 tokens, "
                    "context and tensor parallelism, CPU offload) with the estimate-memory accounting "
                    "and pick the first that fits --memory per rank, in cost order: wider sharding first, then "
                    "resharding, then checkpointing (each choice followed by itself with the loss tiled: no "
                    "recomputation), then context parallelism, then tensor parallelism, then "
                    "offload. The same decision FSDP2Config(shard_size='auto', memory_budget=...) makes with the "
                    "run's own tp/cp sizes (hf_fsdp2/planner/layout.py). Exits with 1 when nothing fits, naming "
                    "the smallest budget that would.",
    )
    _add_model_setup(p)
    p.add_argument("--memory", required=True, metavar="SIZE",
                   help="budget per rank, e.g. 80GB, 24GiB (what must hold the estimated peak)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (default): offload is a candidate; cpu: one RAM, offload gains nothing")
    p.add_argument("--tp-sizes", type=_sizes, default="auto", metavar="auto|T,T",
                   help="tensor-parallel sizes to cost (default auto: those dividing the world and the model's heads, "
                        "8 at most, when its config has a TP plan; 1: FSDP only)")
    p.add_argument("--cp-sizes", type=_sizes, default="auto", metavar="auto|C,C",
                   help="context-parallel sizes to cost (default auto: those dividing the world and half of --seq-len; "
                        "1: none)")
    p.set_defaults(handler=_run_plan)


def _sizes(text: str):
    if text.strip().lower() == "auto":
        return "auto"
    try:
        sizes = [int(t) for t in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or any(s < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"must be auto or positive integers separated by commas, got {text!r}")
    return sorted(set(sizes) | {1})


def _run_plan(args: argparse.Namespace) -> int:
    import json

    from .config import parse_bytes
    from .planner.layout import parallel_sizes, plan_layout
    from .planner.memory import expert_parallel_options, prepare_meta_model

    try:
        budget = parse_bytes(args.memory, "--memory")
    except (TypeError, ValueError) as e:
        raise ValueError(str(e)) from None
    config, setup = _model_setup(args)
    try:
        prepared = prepare_meta_model(args.model, config, **setup)
        auto_tp, auto_cp = parallel_sizes(prepared, args.world_size, args.seq_len)
        tp_sizes = auto_tp if args.tp_sizes == "auto" else args.tp_sizes
        cp_sizes = auto_cp if args.cp_sizes == "auto" else args.cp_sizes
        for flag, given in (("--tp-sizes", args.tp_sizes), ("--cp-sizes", args.cp_sizes)):
            bad = [] if given == "auto" else [n for n in given if args.world_size % n]
            if bad:  # costing nothing for them would drop them silently
                raise ValueError(f"`{flag}` {','.join(map(str, bad))} does not divide `--world-size` {args.world_size}.")
        plan = plan_layout(prepared, args.world_size, config, budget_bytes=budget, budget_source="--memory",
                           device_type=args.device, batch_size=args.batch_size, seq_len=args.seq_len,
                           tp_sizes=tp_sizes, cp_sizes=cp_sizes)
        proposals = expert_parallel_options(prepared, plan, config, batch_size=args.batch_size, seq_len=args.seq_len)
    except ValueError as e:
        raise _flag_names(e) from None
    if args.json:
        def row(c):
            return {"shard_size": c.shard_size, "replicate_size": c.replicate_size, "tp_size": c.tp_size,
                    "cp_size": c.cp_size,
                    "reshard_after_forward": c.reshard_after_forward,
                    "activation_checkpointing": c.activation_checkpointing, "checkpoint_every": c.checkpoint_every,
                    "checkpoint_save_matmuls": c.checkpoint_save_matmuls,
                    "activation_offload": c.activation_offload, "loss_tile_size": c.loss_tile_size,
                    "mlp_tile_size": c.mlp_tile_size, "cpu_offload": c.cpu_offload,
                    "needed_bytes": c.needed_bytes, "host_bytes": c.host_bytes, "fits": c.fits,
                    "heap_kept_bytes": c.estimate.heap_kept_bytes, "returns_freed_memory": c.returns_freed_memory}
        print(json.dumps({"budget_bytes": budget, "world_size": args.world_size, "device": args.device,
                          "chosen": row(plan.chosen) if plan.chosen else None,
                          "returns_freed_memory": plan.returns_freed_memory,
                          "smallest_workable_budget": plan.smallest_workable_budget,
                          "candidates": [row(c) for c in plan.candidates],
                          "expert_parallel": [{"ep_size": ep, "device_bytes": e.device_bytes,
                                               "gathered_peak_bytes": e.gathered_peak_bytes,
                                               "all_to_all_bytes": e.all_to_all_bytes} for ep, e in proposals]},
                         indent=2))
    else:
        print(plan.format_table())
        if proposals:
            from .planner.memory_report import format_bytes

            chosen = plan.chosen.estimate
            print(f"mixture of experts: expert parallelism splits each layer's experts over ep ranks of the shard group "
                  f"(FSDP2Config(ep_size=E), or HF_FSDP2_EP_SIZE=E under accelerate launch); with the chosen layout "
                  f"(all-gather peak {format_bytes(chosen.gathered_peak_bytes)}, peak {format_bytes(chosen.device_bytes)}):")
            for ep, e in proposals:
                print(f"  ep_size={ep}: all-gather peak {format_bytes(e.gathered_peak_bytes)}, one token exchange "
                      f"{format_bytes(e.all_to_all_bytes)}, peak {format_bytes(e.device_bytes)}")
    return 0 if plan.chosen else 1


if __name__ == "__main__":
    sys.exit(main())
