"""The argparse parser every spmd command uses, and a way to get a command's parser without
running the command (for shell completion, spmd.completion)."""

from __future__ import annotations

import argparse
import difflib
import sys
import typing
from collections.abc import Callable, Sequence
from typing import Any

_capturing = False


class ParserBuilt(BaseException):
    """Raised instead of parsing while `built_parser` captures a command's parser. A
    BaseException, so that no command's `except Exception` takes it for a failure."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__("parser built")
        self.parser = parser


class Parser(argparse.ArgumentParser):
    """argparse that reports mistakes in one line and suggests the nearest flag."""

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: Any = None
    ) -> tuple[argparse.Namespace, list[str]]:
        if _capturing:
            raise ParserBuilt(self)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> typing.NoReturn:
        if message.startswith("unrecognized arguments:"):
            bad = message.split(":", 1)[1].split()[0]
            flags = [a for action in self._actions for a in action.option_strings]
            near = difflib.get_close_matches(bad.split("=")[0], flags, n=1)
            hint = f"; did you mean {near[0]}?" if near else "; see --help for the flags"
            message = f"unknown flag {bad}{hint}"
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def built_parser(command_main: Callable[[list[str]], Any]) -> argparse.ArgumentParser:
    """The parser `command_main` (a command's `main(argv)`) builds, taken at the moment it
    would parse: nothing the command does after parsing (devices, files) runs."""
    global _capturing
    _capturing = True
    try:
        command_main([])
    except ParserBuilt as built:
        return built.parser
    finally:
        _capturing = False
    raise RuntimeError(f"{command_main.__module__}.main returned without parsing its flags")
