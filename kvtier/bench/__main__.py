"""``python -m kvtier.bench``: the same as ``kvtier bench`` (same parser, same errors).

The program runs the command (``kvtier bench ...``), so the dependency runs one way,
command -> benchmarks: this entry script is the only file under ``kvtier/bench/`` that
names the CLI, and nothing imports it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from kvtier.cli import main as kvtier_main


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``kvtier bench`` with ``argv`` (default: this program's arguments)."""
    return kvtier_main(["bench", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
