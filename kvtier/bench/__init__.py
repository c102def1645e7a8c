"""``kvtier bench``: benchmark kvtier's tiers on this machine, verifying every byte.

Two workloads share one set of options (:mod:`kvtier.bench.options`):

- ``single`` (:mod:`kvtier.bench.single`, the default and the README's main job): back
  pages up device -> host -> storage and read them back, next to raw ``os.pwritev`` /
  ``os.preadv`` of the same bytes;
- ``multiturn`` (:mod:`kvtier.bench.multiturn`): simulated conversations that share
  prefixes, through :class:`~kvtier.cache.TieredCache`.

The CLI delegates here: :func:`add_arguments` fills its parser and :func:`run` runs it.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from kvtier.bench import multiturn, single
from kvtier.bench.options import add_common_arguments, remember_defaults
from kvtier.core.errors import KvtierError

if TYPE_CHECKING:
    from kvtier.plugins.registry import Registry

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every ``kvtier bench`` option to ``parser``: the shared ones, then each workload's."""
    parser.epilog = single.EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    add_common_arguments(parser)
    multiturn.add_arguments(parser)
    remember_defaults(parser)


def run(args: argparse.Namespace, *, registry: Registry | None = None) -> int:
    """Run the workload ``args.workload`` names and print its report (or ``--json``).

    Exit status: 0 when every page came back bit-exact, 1 when one failed or differed, 2
    when the options or the configuration were rejected (checked before the run; the
    error goes to stderr as ``kvtier bench: error: ...``, no traceback).
    """
    workload = multiturn.run_multiturn if args.workload == "multiturn" else single.run_bench
    try:
        result = workload(args, registry=registry)
    except KvtierError as exc:  # a rejected configuration: the message says what would work
        sys.stderr.write(f"kvtier bench: error: {exc}\n")
        return 2
    sys.stdout.write((json.dumps(result.to_dict()) if args.json else result.report()) + "\n")
    return 0 if result.ok else 1
