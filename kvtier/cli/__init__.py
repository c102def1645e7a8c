"""The ``kvtier`` command: list backends, check a configuration, run benchmarks.

``kvtier check`` resolves a configuration exactly as an engine does at start-up (same
parser, same validation, same capability resolution), so an operator learns before
launching a server whether the plan works, and if not, what would.

This module is the entry point (:func:`main`, the ``kvtier`` console script) and builds
the parser; each command lives in its own module (:mod:`kvtier.cli.backends`,
:mod:`kvtier.cli.check`, :mod:`kvtier.cli.bench`), and what they share in
:mod:`kvtier.cli.common`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvtier._version import __version__
from kvtier.cli import backends, bench, check
from kvtier.cli.common import (
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_OK,
    Formatter,
    Parser,
    load_registry,
    print_error,
    unrecognized,
)
from kvtier.core.errors import KvtierError

if TYPE_CHECKING:
    from kvtier.plugins.registry import Registry

__all__ = ["EXIT_ERROR", "EXIT_OK", "build_parser", "main"]

_EPILOG = """\
examples:
  kvtier backends
      every storage and IO backend: plugin, version, availability, capabilities, options
  kvtier backends --json
      the same as stable JSON, for scripts
  kvtier check --backend memory --num-layers 32 --num-kv-heads 8 --head-dim 128
      resolve a plan the way an engine does at start-up and print it
  kvtier check --backend memory --extra-config '{"capacity_bytes": 1073741824}'
      check a backend's own options (JSON in single quotes, so the shell keeps the ")
  kvtier check --config @engine.toml --io-backend kernel --layout page_first
      a whole engine config from a file, with two fields overridden
  kvtier bench --help
      benchmarks (when this build has them)

exit status: 0 when the command succeeded, 2 when a configuration was rejected or a
plugin failed; the reason goes to stderr, never a traceback.
"""


def build_parser() -> Parser:
    """The ``kvtier`` argument parser with every subcommand."""
    parser = Parser(
        prog="kvtier",
        description="kvtier: tiered, pluggable KV-cache storage for LLM serving engines.\n"
        "List the installed backends, check a configuration before starting an engine, "
        "run benchmarks.",
        epilog=_EPILOG,
        formatter_class=Formatter,
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="log kvtier's decisions (what `auto` picked) to stderr",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="_kvtier_command", metavar="COMMAND", required=True)
    backends.add_command(sub)
    check.add_command(sub)
    bench.add_command(sub)
    return parser


def main(argv: Sequence[str] | None = None, *, registry: Registry | None = None) -> int:
    """Run the ``kvtier`` command; returns the exit status (0 ok, 2 rejected).

    ``registry`` replaces the installed plugins (for tests and embedding engines).
    """
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
        if extra and not getattr(args, "kvtier_any_args", False):
            sub: Parser = getattr(args, "kvtier_parser", parser)
            sub.error(unrecognized(sub, extra))
    except SystemExit as exc:  # --help, --version, or a usage error argparse printed
        return exc.code if isinstance(exc.code, int) else EXIT_ERROR
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("kvtier")
    if args.verbose:
        logger.addHandler(handler)
        previous = logger.level
        logger.setLevel(logging.INFO)
    try:
        run: Callable[[argparse.Namespace], int] | None = getattr(args, "kvtier_run", None)
        if run is not None:
            try:
                return int(run(args))
            except KvtierError as exc:  # a bench that did not catch its own config error
                print_error(exc)
                return EXIT_ERROR
            except KeyboardInterrupt:
                sys.stderr.write("kvtier: interrupted\n")
                return EXIT_INTERRUPTED
        command: Callable[[argparse.Namespace, Registry], int] = args.kvtier_registry_cmd
        try:
            loaded = registry if registry is not None else load_registry()
        except KvtierError as exc:
            print_error(exc)
            return EXIT_ERROR
        return command(args, loaded)
    finally:
        if args.verbose:
            logger.removeHandler(handler)
            logger.setLevel(previous)
