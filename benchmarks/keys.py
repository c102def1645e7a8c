"""Page-key throughput: PageKeyer.keys against raw hashlib over the same page bytes.

Usage: ``python benchmarks/keys.py [--quick] [--cpu-time]``. One JSON object per line on stdout (one
per input type, ours vs raw ``hashlib.blake2b`` per page with no chaining, keying or
formatting, plus one line against the 10 M tokens/s target); a table on stderr.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvtier.core.keys import Namespace, PageKeyer, token_bytes

PAGE = 64
TARGET_TOKENS_PER_S = 10_000_000


CLOCK: Callable[[], float] = time.perf_counter


def timed(fn: Callable[[], Any]) -> float:
    start = CLOCK()
    fn()
    return CLOCK() - start


def raw_hashlib(data: bytes, page: int) -> Callable[[], None]:
    """The raw side: one hashlib call per full page over pre-converted bytes."""
    view = memoryview(data)
    step = page * 4

    def run() -> None:
        blake = hashlib.blake2b
        for start in range(0, len(view) - step + 1, step):
            blake(view[start : start + step], digest_size=32).digest()

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens and repetitions")
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time with this process's CPU time instead of wall time (steadier on a host "
        "shared with other jobs; both sides are single-threaded)",
    )
    args = parser.parse_args()
    global CLOCK
    clock_name = "wall"
    if args.cpu_time:
        CLOCK, clock_name = time.process_time, "cpu"
    n_tokens = (1 << 18) if args.quick else (1 << 20)
    reps = 5 if args.quick else 9

    rng = np.random.default_rng(0)
    ids = rng.integers(0, 152_000, size=n_tokens, dtype=np.int64)
    inputs: dict[str, Any] = {
        "numpy int64": ids,
        "torch int64": torch.from_numpy(ids.copy()),
        "list[int]": ids.tolist(),
    }
    keyer = PageKeyer(
        Namespace("bench-model", "0123456789abcdef", tenant="t"), PAGE, tp_rank=1, tp_size=2
    )
    raw = raw_hashlib(token_bytes(ids), PAGE)

    lines = []
    slowest: tuple[float, str] = (float("inf"), "")
    for name, tokens in inputs.items():
        ours_fn = lambda tokens=tokens: keyer.keys(tokens)  # noqa: E731
        ours_fn()
        raw()  # warm-up
        ours_t, raw_t = [], []
        for _ in range(reps):  # interleaved
            ours_t.append(timed(ours_fn))
            raw_t.append(timed(raw))
        ours = n_tokens / statistics.median(ours_t)
        base = n_tokens / statistics.median(raw_t)
        slowest = min(slowest, (ours, name))
        lines.append(
            {
                "bench": "keys",
                "case": f"{n_tokens} tokens, {PAGE}-token pages, {name}"
                + ("" if clock_name == "wall" else ", cpu time"),
                "ours": round(ours),
                "baseline": round(base),
                "baseline_name": "hashlib.blake2b per page, no chaining/keying/formatting",
                "unit": "tokens/s",
                "ratio": round(ours / base, 3),
                "target": None,
            }
        )
    lines.append(
        {
            "bench": "keys",
            "case": f"{n_tokens} tokens, {PAGE}-token pages, slowest input ({slowest[1]}) "
            "vs 10M tokens/s" + ("" if clock_name == "wall" else ", cpu time"),
            "ours": round(slowest[0]),
            "baseline": TARGET_TOKENS_PER_S,
            "baseline_name": "target 10M tokens/s",
            "unit": "tokens/s",
            "ratio": round(slowest[0] / TARGET_TOKENS_PER_S, 3),
            "target": 1.0,
        }
    )
    print(f"{'case':<72} {'ours Mtok/s':>12} {'raw Mtok/s':>11} {'ratio':>6}", file=sys.stderr)
    for line in lines:
        print(
            f"{line['case']:<72} {line['ours'] / 1e6:>12.1f} {line['baseline'] / 1e6:>11.1f} "
            f"{line['ratio']:>6.2f}",
            file=sys.stderr,
        )
        print(json.dumps(line))


if __name__ == "__main__":
    main()
