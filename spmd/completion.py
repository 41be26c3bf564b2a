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
from spmd.estimate import search
from spmd.run.parser import Parser, built_parser

# flags (by field) that name a folder; the other path flags name files (or either)
FOLDER_FLAGS = {
    "checkpoint", "checkpoint_dir", "data_cache", "from_hf", "init_from_hf", "lora_base",
    "profile_dir", "run_dir", "tensorboard", "to", "to_hf", "to_peft",
}  # fmt: skip
FILE_FLAGS = {"config", "data", "eval_data", "json", "metrics", "out", "plot", "prompts_file"}
# flags (by field) whose values are the keys of a table, listed when the script is made
TABLE_CHOICES = {"gpu": lambda: list(search.GPUS)}
# what follows an action word: (its name, shtab's completion of it)
ACTION_OPERANDS = {"checkpoint": ("folders", shtab.DIRECTORY)}


def command_tree() -> argparse.ArgumentParser:
    """An `spmd` parser with one subcommand per spmd command, each holding that command's own
    flags (taken from the parser the command builds), with choices and path hints set. A
    command whose first word is an action (its module's ACTIONS: `spmd data preview|stats`,
    `spmd checkpoint verify DIR`) completes that word from them."""
    top = argparse.ArgumentParser(prog="spmd", description=usage())
    commands = top.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, about) in COMMANDS.items():
        module = importlib.import_module(module_name)
        own = built_parser(module.main)
        sub = commands.add_parser(name, help=about, parents=[own], add_help=False)
        if hasattr(module, "ACTIONS"):
            _split_action_word(sub, module.ACTIONS, ACTION_OPERANDS.get(name))
        for action in sub._actions:
            _hint(action)
    return top


def _split_action_word(
    sub: argparse.ArgumentParser, words: tuple[str, ...], operands: tuple | None
) -> None:
    """The command's positional as its action word (one of `words`) and, where the command
    takes more after it, `operands` (their name and shtab's completion of them). (shtab's
    bash script does not descend into nested subparsers, so the words are a positional's
    choices, not subcommands.)"""
    (positional,) = [a for a in sub._actions if not a.option_strings]
    positional.nargs, positional.choices = None, list(words)
    if operands is not None:
        name, complete = operands
        sub.add_argument(name, nargs="*").complete = complete  # type: ignore[attr-defined]


def _hint(action: argparse.Action) -> None:
    """Choices from the `A|B|C` metavar --help shows or from a table (the resolver checks
    them, argparse does not); shtab's file or folder completion for path flags."""
    metavar = action.metavar if isinstance(action.metavar, str) else ""
    if action.dest in TABLE_CHOICES:
        action.choices = TABLE_CHOICES[action.dest]()
    elif metavar == "BOOL":
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
