"""`hf-fsdp2`: command-line tools. One subcommand per `_add_<name>` function, each with its own handler.

Handlers import their module lazily, so `hf-fsdp2 --help` does not pay for importing torch.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-fsdp2", description="PyTorch FSDP2 tools for Hugging Face models.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_convert(commands)
    _add_check_config(commands)
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
    from .convert import convert_dcp_to_safetensors

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
    from .check_config import ConfigFileError, check_accelerate_config, render

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


if __name__ == "__main__":
    sys.exit(main())
