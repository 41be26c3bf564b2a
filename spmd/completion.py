"""`spmd completion SHELL`: a tab-completion script for the `spmd` command, made by shtab from
the commands' own parsers (every flag, each choice set, files and folders where a flag takes a
path), so that it never lists a flag the commands lack.

    spmd completion bash > ~/.local/share/bash-completion/completions/spmd
    spmd completion zsh > "${fpath[1]}/_spmd"
"""

from __future__ import annotations

import argparse
import importlib
import sys

import shtab

from spmd.commands import COMMANDS, usage
from spmd.errors import run_command
from spmd.parser import Parser, built_parser

# flags (by field) that name a folder; the other path flags name files (or either)
FOLDER_FLAGS = {
    "checkpoint", "checkpoint_dir", "data_cache", "from_hf", "init_from_hf", "profile_dir",
    "run_dir", "tensorboard", "to", "to_hf", "to_peft",
}  # fmt: skip
FILE_FLAGS = {"config", "data", "eval_data", "json", "metrics", "out", "plot", "prompts_file"}


def command_tree() -> argparse.ArgumentParser:
    """An `spmd` parser with one subcommand per spmd command, each holding that command's own
    flags (taken from the parser the command builds), with choices and path hints set."""
    top = argparse.ArgumentParser(prog="spmd", description=usage())
    commands = top.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, about) in COMMANDS.items():
        own = built_parser(importlib.import_module(module).main)
        sub = commands.add_parser(name, help=about, parents=[own], add_help=False)
        for action in sub._actions:
            _hint(action)
    return top


def _hint(action: argparse.Action) -> None:
    """Choices from the `A|B|C` metavar --help shows (the resolver checks them, argparse does
    not); shtab's file or folder completion for path flags."""
    metavar = action.metavar if isinstance(action.metavar, str) else ""
    if metavar == "BOOL":
        action.choices = ["true", "false"]
    elif "|" in metavar and '""' not in metavar:
        action.choices = metavar.split("|")
    elif action.dest in FOLDER_FLAGS:
        action.complete = shtab.DIRECTORY  # type: ignore[attr-defined]
    elif action.dest in FILE_FLAGS:
        action.complete = shtab.FILE  # type: ignore[attr-defined]


def main(argv: list[str] | None = None) -> int:
    return run_command(run, argv)


def run(argv: list[str] | None) -> int:
    parser = Parser(prog="spmd completion", description=__doc__)
    parser.add_argument("shell", choices=["bash", "zsh", "tcsh"], help="the shell to complete in")
    shell = parser.parse_args(sys.argv[1:] if argv is None else argv).shell
    print(shtab.complete(command_tree(), shell=shell))
    return 0


if __name__ == "__main__":
    sys.exit(main())
