"""Helpers the benchmark scripts share (imported from the scripts' own directory)."""

from __future__ import annotations

import statistics
from collections.abc import Callable


def interleaved_medians(cases: dict[str, Callable[[], float]], reps: int) -> dict[str, float]:
    """Warm every case up once, then ``reps`` rounds taking the cases in turn; medians.

    Interleaving keeps both sides of a comparison under the same machine conditions,
    which drift on shared VMs; each case returns one sample (seconds or a rate).
    """
    for case in cases.values():
        case()
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(reps):
        for name, case in cases.items():
            samples[name].append(case())
    return {name: statistics.median(values) for name, values in samples.items()}
