"""MkDocs hook (mkdocs.yml `hooks:`): docs/cli.md's reference is generated from the parsers `hf-fsdp2` runs.

The page holds the marker `<!-- cli-reference -->`; at build time it is replaced by `hf-fsdp2 --help` and each
subcommand's `--help`, as `hf_fsdp2.cli.build_parser()` formats them (no hand-kept copy of the help text).
"""

from __future__ import annotations

import argparse
import os

from mkdocs.exceptions import PluginError

MARKER = "<!-- cli-reference -->"
WIDTH = "100"  # argparse wraps to $COLUMNS: a fixed width, so the page does not depend on the terminal


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]  # argparse keeps them here
    return dict(actions[0].choices) if actions else {}


def _help(parser: argparse.ArgumentParser) -> str:
    return f"```text\n{parser.format_help().rstrip()}\n```\n"


def cli_reference() -> str:
    from hf_fsdp2.cli import build_parser

    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH
    try:
        parser = build_parser()
        parts = ["## hf-fsdp2\n", _help(parser)]
        for name, sub in _subcommands(parser).items():
            parts += [f"## hf-fsdp2 {name}\n", _help(sub)]
    finally:
        if columns is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = columns
    return "\n".join(parts)


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ARG001 (MkDocs' hook signature)
    if page.file.src_uri != "cli.md":
        return markdown
    if MARKER not in markdown:
        raise PluginError(f"docs/cli.md has lost its {MARKER} marker: the CLI reference would not be generated.")
    return markdown.replace(MARKER, cli_reference())
