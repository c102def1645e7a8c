"""``kvtier bench``: the wiring from the command to :mod:`kvtier.bench`, which runs it.

The dependency runs one way: the command imports the benchmarks (by name, when the
parser is built), never the reverse. A missing or broken benchmark module disables
only ``kvtier bench``, with the reason; every other command keeps working.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any

from kvtier.cli.common import EXIT_ERROR, Formatter, Subcommands

__all__ = ["add_command"]


def add_command(sub: Subcommands) -> None:
    """Delegate ``kvtier bench`` to :mod:`kvtier.bench`, or say why it cannot run.

    A missing or broken benchmark module only disables ``kvtier bench``; every other
    command keeps working.
    """
    bench: Any = None
    reason = ""
    try:
        # importlib rather than "from kvtier import bench": mypy passes with or without it.
        bench = importlib.import_module("kvtier.bench")
        if not (
            callable(getattr(bench, "add_arguments", None))
            and callable(getattr(bench, "run", None))
        ):
            raise AttributeError("kvtier.bench must define add_arguments(parser) and run(args)")
    except Exception as exc:
        missing = isinstance(exc, ImportError) and exc.name in ("kvtier", "kvtier.bench")
        reason = (
            "kvtier bench is not available yet in this build (there is no kvtier.bench module)"
            if missing
            else f"kvtier bench cannot start: importing kvtier.bench failed: {exc!r}"
        )
        bench = None
    doc = (getattr(bench, "__doc__", None) or "Run kvtier benchmarks.").strip()
    parser = sub.add_parser(
        "bench",
        help="run benchmarks" if bench is not None else "run benchmarks (not available)",
        description=doc if bench is not None else reason,
        formatter_class=Formatter,
    )
    if bench is not None:
        try:
            bench.add_arguments(parser)
        except Exception as exc:
            reason = f"kvtier bench cannot start: kvtier.bench.add_arguments failed: {exc!r}"
        else:
            parser.set_defaults(kvtier_run=bench.run, kvtier_parser=parser)
            return

    def unavailable(args: argparse.Namespace) -> int:
        sys.stderr.write(f"kvtier: error: {reason}\n")
        return EXIT_ERROR

    # Whatever arguments were meant for the benchmarks are accepted and ignored.
    parser.set_defaults(kvtier_run=unavailable, kvtier_any_args=True)
