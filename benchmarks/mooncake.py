"""Mooncake backend vs the bare Mooncake client on the same registered memory.

    python benchmarks/mooncake.py [--quick] [--pages N] [--reps N]

Starts its own ``mooncake_master`` on loopback. Pages are 8 MiB MLA pages in a
``page_first`` host pool (one 8 MiB payload extent plus the 4 KiB envelope header slot,
in two registered slabs). Our side is ``MooncakeBackend.put/get`` (batch_remove for
replace-on-put, then the multi-buffer batch calls); the baseline is the same client's
``batch_put_from`` / ``batch_get_into`` of each page's 8 MiB payload. Both move the same
pool memory, interleaved, after a warm-up; medians of ``--reps`` (7). Throughput counts
payload bytes only (ours moves 4 KiB more per page). A second, untargeted baseline is the
bare client's multi-buffer calls on the very same [header, payload] buffers: the ratio
against it is kvtier's own overhead, the rest is Mooncake's multi-buffer path. Cases:

* same-process: the benchmark process holds the global segment;
* cross-process: a ``mooncake_client`` storage node holds it, so every byte crosses to
  another process over TCP.

256 x 8 MiB needs ~2 GiB of pool plus ~2.6 GiB of segment; --quick uses 32 pages.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from kvtier.backends.mooncake import MooncakeConfig
from kvtier.backends.mooncake.backend import MooncakeBackend
from kvtier.core.geometry import KVGeometry
from kvtier.core.host_pool import HostPool
from kvtier.core.layout import Layout
from kvtier.core.storage import BackendContext
from kvtier.testing.mooncake import MooncakeMaster, mooncake_unavailable_reason, use_client_env

MIB = 1 << 20
#: 64 layers x (448 + 64) dims x 2 bytes x 128 tokens = 8 MiB per page.
GEOMETRY = KVGeometry.mla(
    num_layers=64, kv_lora_rank=448, qk_rope_head_dim=64, dtype="bfloat16", page_size=128
)


def _median_rate(samples: list[float], nbytes: int) -> float:
    return nbytes / statistics.median(samples) / 1e9


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_case(case: str, pages: int, reps: int, storage_node: bool) -> list[dict[str, Any]]:
    """Measure put and get, ours vs bare, for one placement of the global segment."""
    payload = GEOMETRY.bytes_per_page
    segment = int(pages * (payload + 4096) * 1.3) + 64 * MIB
    rows: list[dict[str, Any]] = []
    with MooncakeMaster(storage_node_bytes=segment if storage_node else 0) as master:
        config = MooncakeConfig(
            master_address=master.address,
            global_segment_size=0 if storage_node else segment,
        )
        context = BackendContext(GEOMETRY, Layout.PAGE_FIRST, namespace="bench")
        backend = MooncakeBackend(config, context)
        try:
            pool = HostPool(GEOMETRY, Layout.PAGE_FIRST, num_pages=pages, pin_memory=False)
            backend.attach(pool)
            ids = pool.allocate(pages)
            buffers = [pool.page_buffers(p) for p in ids]
            for i, page in enumerate(buffers):  # touch every byte once
                for extent in page:
                    torch.frombuffer(extent.view, dtype=torch.uint8).fill_(i % 251)
            assert all(len(b) == 2 for b in buffers), "expected header + one payload extent"
            client = backend._client  # the bare client, same registered memory
            keys = [f"p{i}" for i in range(pages)]
            raw_keys = [f"raw/{case}/{i}" for i in range(pages)]
            ptrs = [b[1].ptr for b in buffers]
            sizes = [payload] * pages

            def clear() -> None:
                backend.clear()
                client.remove_by_regex(f"^raw/{case}/", True)

            def ours_put() -> None:
                assert backend.put(keys, buffers) == [True] * pages

            def ours_get() -> None:
                assert backend.get(keys, buffers) == [True] * pages

            def bare_put() -> None:
                assert all(c == 0 for c in client.batch_put_from(raw_keys, ptrs, sizes))

            def bare_get() -> None:
                assert all(c == payload for c in client.batch_get_into(raw_keys, ptrs, sizes))

            multi_ptrs = [[b[0].ptr, b[1].ptr] for b in buffers]
            multi_sizes = [[b[0].length, b[1].length] for b in buffers]

            def multi_put() -> None:
                codes = client.batch_put_from_multi_buffers(raw_keys, multi_ptrs, multi_sizes)
                assert all(c == 0 for c in codes)

            def multi_get() -> None:
                codes = client.batch_get_into_multi_buffers(raw_keys, multi_ptrs, multi_sizes)
                assert all(c == payload + 4096 for c in codes)

            sides = [("o", ours_put, ours_get), ("b", bare_put, bare_get)]
            sides.append(("m", multi_put, multi_get))
            samples: dict[str, list[float]] = {s + op: [] for s, _, _ in sides for op in "pg"}
            for rep in range(reps + 1):  # rep 0 is the warm-up
                order = sides[rep % len(sides) :] + sides[: rep % len(sides)]
                for side, put, get in order:
                    clear()
                    t_put = _timed(put)
                    t_get = _timed(get)
                    if rep:
                        samples[side + "p"].append(t_put)
                        samples[side + "g"].append(t_get)
            check = bytes(buffers[-1][1].view[:64])
            assert check == bytes([(pages - 1) % 251]) * 64, "data changed in the round trips"
            clear()
        finally:
            backend.close()
    nbytes = pages * payload
    baselines = (
        ("b", "MooncakeDistributedStore.batch_{}", 0.9, ""),
        ("m", "MooncakeDistributedStore.batch_{}_multi_buffers", None, " vs multi-buffer"),
    )
    for op, verb, api in (("p", "put", "put_from"), ("g", "get", "get_into")):
        ours = _median_rate(samples["o" + op], nbytes)
        for side, name, target, suffix in baselines:
            bare = _median_rate(samples[side + op], nbytes)
            rows.append(
                {
                    "bench": "mooncake",
                    "case": f"{verb} {pages}x8MiB {case}{suffix}",
                    "ours": round(ours, 3),
                    "baseline": round(bare, 3),
                    "baseline_name": name.format(api),
                    "unit": "GB/s",
                    "ratio": round(ours / bare, 3),
                    "target": target,
                }
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="32 pages, < 1 minute")
    parser.add_argument("--pages", type=int, default=None)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument(
        "--cases", default="same-process,cross-process", help="comma-separated cases"
    )
    args = parser.parse_args(argv)
    # This file is named mooncake.py: keep its directory off sys.path, or ``import
    # mooncake`` would find this script instead of the Mooncake package.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    reason = mooncake_unavailable_reason()
    if reason is not None:
        print(f"mooncake benchmark skipped: {reason}", file=sys.stderr)
        return 0
    use_client_env()
    pages = args.pages or (32 if args.quick else 256)
    rows: list[dict[str, Any]] = []
    for case in args.cases.split(","):
        rows += run_case(case, pages, args.reps, storage_node=case == "cross-process")
    print(f"{'case':<50} {'ours':>8} {'bare':>8} {'ratio':>6}", file=sys.stderr)
    for row in rows:
        print(json.dumps(row), flush=True)
        print(
            f"{row['case']:<50} {row['ours']:>8.2f} {row['baseline']:>8.2f} {row['ratio']:>6.2f}",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
