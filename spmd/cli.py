"""`spmd COMMAND [FLAGS]`: the installed command, one word per `python -m spmd.COMMAND`.

    spmd train --mesh dp=2,tp=4        is   python -m spmd.train --mesh dp=2,tp=4
    spmd plan --params 7e9 --gpu h100  is   python -m spmd.plan --params 7e9 --gpu h100

Each command parses its own flags (spmd.run.config.resolve); `spmd COMMAND --help` lists them.
The commands are spmd.commands.COMMANDS.
"""

from __future__ import annotations

import importlib
import sys

from spmd.commands import COMMANDS, usage
from spmd.errors import end_process


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(
            f"error: {name!r} is not an spmd command; choose one of {', '.join(COMMANDS)}",
            file=sys.stderr,
        )
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return module.main(rest)


def command() -> None:
    """The `spmd` console script: `main` as the process (spmd.errors.end_process: it does not
    wait on the threads a failed or interrupted save leaves)."""
    end_process(main)


if __name__ == "__main__":
    command()
