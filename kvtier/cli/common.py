"""What every ``kvtier`` command shares: exit statuses, the JSON format, usage errors.

The parser and help formatter here make each usage error one line that names the
culprit and where to look (with "did you mean" for a misspelt option), and
:func:`print_error` is the one way a command reports a rejected configuration.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

if TYPE_CHECKING:
    from kvtier.plugins.registry import Registry

__all__ = [
    "EXIT_ERROR",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "JSON_FORMAT",
    "Formatter",
    "Parser",
    "Subcommands",
    "load_registry",
    "print_error",
    "unrecognized",
]

EXIT_OK = 0
#: A configuration that was rejected, a plugin that failed, a command not available.
EXIT_ERROR = 2

#: Stopped by Ctrl-C (128 + SIGINT, as shells report it).
EXIT_INTERRUPTED = 130

#: JSON output format version of ``kvtier backends --json`` and ``kvtier check --json``.
JSON_FORMAT = 1


class Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line: what was wrong, where to look."""

    def error(self, message: str) -> NoReturn:
        """Exit with :data:`EXIT_ERROR` and one line on stderr, pointing at ``--help``."""
        self.exit(EXIT_ERROR, f"{self.prog}: error: {message}; see '{self.prog} --help'\n")

    def flags(self) -> list[str]:
        """Every option string this parser takes (``--pages``, ``-h``...)."""
        return [flag for action in self._actions for flag in action.option_strings]


class Subcommands(Protocol):
    """What a command module needs of the parser's subcommands: a way to add one."""

    def add_parser(self, name: str, **kwargs: Any) -> Parser: ...


def unrecognized(parser: Parser, extra: list[str]) -> str:
    """The usage error for ``extra``, with the closest option when one was misspelt."""
    message = f"unrecognized arguments: {' '.join(extra)}"
    known = parser.flags()
    for arg in extra:
        if arg.startswith("--"):
            close = difflib.get_close_matches(arg.split("=")[0], known, n=1)
            if close:
                return f"{message} (did you mean {close[0]}?)"
    return message


class Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the hand-wrapped examples; wide enough for the option table."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=32, width=100)


def load_registry() -> Registry:
    """The registry of installed plugins (imported here: the CLI sits on top of plugins)."""
    from kvtier.plugins.manager import load_registry as load_installed

    return load_installed()


def print_error(exc: BaseException) -> None:
    """Report ``exc`` as one ``kvtier: error: ...`` line on stderr, never a traceback."""
    sys.stderr.write(f"kvtier: error: {exc}\n")
