"""What the device benchmarks share: the device to measure on, and how a result is printed.

``benchmarks/gpu.py`` and ``benchmarks/engine_loop.py`` run on CUDA (the GPU check) or,
small, on the CPU (their tests); both print one JSON line per result on stdout, for a
script, and one table row on stderr, for a person.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch


def pick_device(name: str | None) -> torch.device:
    """``name``, or cuda where it is available and else cpu; a clear error if unusable."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise SystemExit(
            f"--device: {name!r} is not a torch device ({exc}); use cpu or cuda"
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device: {name!r} needs CUDA, which this torch/machine lacks")
    if device.type not in ("cpu", "cuda"):
        raise SystemExit(f"--device: {name!r}: only cpu and cuda are measured here")
    return device


def emit(record: dict[str, Any], table: str) -> None:
    """One JSON line on stdout, one table row on stderr."""
    print(json.dumps(record), flush=True)
    print(table, file=sys.stderr, flush=True)
