"""The load path next to the backup path: host -> device vs device -> host, per IO backend
and layout, on CPU tensors, with the latency of every call.

    python benchmarks/io.py [--quick] [--pages N] [--calls C] [--reps R] [--threads T]
                            [--io-backends direct,kernel] [--layouts page_first,...]
                            [--slots contiguous,pages,tokens]

For each IO backend (``direct``, ``kernel``), layout (``layer_first``, ``page_first``,
``page_first_direct``, ``page_head``) and slot pattern, an 8B-class geometry (32 layers,
8 KV heads, head dim 128, bf16, 64-token pages = 8 MiB per page; ``--quick``: fewer
pages and calls) moves every page of a host pool and a device pool of the same size,
both allocated and touched once:

- ``backup``: ``io.backup(device, host, slots, pages)``, device -> host;
- ``load``: ``io.load(host, device, pages, slots)``, host -> device, the mirror image;
- ``copy_``: one contiguous ``tensor.copy_`` of the same bytes between two buffers of
  their own, the memory-bandwidth floor (informational).

Slot patterns: ``contiguous`` (the device's slots in order, as ``kvtier bench`` moves
them: one run), ``pages`` (whole device pages in random order, host pages in order, as
an engine's block table gives them) and ``tokens`` (scattered token slots; ``kernel``
only, ``direct`` refuses them).

Each round makes ``--calls`` calls of each side, interleaved (backup, load, copy_, then
the reverse, and so on), after an untimed warm-up call of each; the page contents are
checked bit-exact after the last round (device zeroed, loaded back, compared). One JSON
line per case on stdout (DESIGN.md's form): ``ours`` is load GB/s and ``baseline``
backup GB/s (medians over rounds), ``ratio`` the median per-round load / backup (target
0.8: a load within 0.8x of its backup) with its ``spread``; beside them the per-call
``p50_ms`` / ``p99_ms`` of each side and ``p99_over_p50`` (target under 2). A table on
stderr.

``--threads`` sets torch's intra-op threads (default: torch's own, as ``kvtier bench``
runs). Speed is measured here, never in a test; run it on a quiet machine for figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvtier.core.device_pool import TorchDevicePool
from kvtier.core.geometry import KVGeometry
from kvtier.core.host_pool import HostPool
from kvtier.core.io import DIRECT_SPEC, KERNEL_SPEC, IOBackend
from kvtier.core.layout import Layout
from kvtier.core.specs import IOBackendSpec

GB = 1e9
BENCH = "io"
LOAD_TARGET = 0.8
P99_TARGET = 2.0
SPECS = {"direct": DIRECT_SPEC, "kernel": KERNEL_SPEC}
PATTERNS = ("contiguous", "pages", "tokens")


def percentile(values: Sequence[float], pct: float) -> float:
    """The ``pct`` percentile of ``values`` (linear interpolation)."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * pct / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def make_slots(pattern: str, pages: int, page_size: int, gen: torch.Generator) -> torch.Tensor:
    """The device slots of ``pages`` pages for a slot pattern (see the module docstring)."""
    if pattern == "contiguous":
        return torch.arange(pages * page_size, dtype=torch.int64)
    if pattern == "pages":
        order = torch.randperm(pages, generator=gen)
        return (order[:, None] * page_size + torch.arange(page_size)).reshape(-1)
    return torch.randperm(pages * page_size, generator=gen)


def build(spec: IOBackendSpec, geometry: KVGeometry, layout: Layout) -> IOBackend:
    io = spec.load_factory()(spec.config_model(), geometry, layout)
    assert isinstance(io, IOBackend)
    return io


def one_case(
    spec: IOBackendSpec,
    layout: Layout,
    pattern: str,
    geometry: KVGeometry,
    pages: int,
    calls: int,
    reps: int,
) -> dict[str, Any]:
    """Every round of one case; its JSON line printed and returned."""
    gen = torch.Generator().manual_seed(0)
    io = build(spec, geometry, layout)
    host = HostPool(geometry, layout, num_pages=pages, pin_memory=False)
    for tensor in host.kv_buffers:  # touched once, up front
        tensor.view(torch.uint8).fill_(0x5A)
    device = TorchDevicePool(geometry, pages * geometry.page_size, "cpu").fill_random_(gen)
    original = [t.clone() for t in device.kv_tensors]
    host_pages = list(range(pages))
    slots = make_slots(pattern, pages, geometry.page_size, gen)
    nbytes = pages * geometry.bytes_per_page
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8).fill_(2)
    sides: dict[str, Callable[[], None]] = {
        "backup": lambda: io.backup(device, host, slots, host_pages),
        "load": lambda: io.load(host, device, host_pages, slots),
        "copy_": lambda: dst.copy_(src),
    }
    for side in sides.values():  # warm-up, untimed
        side()
    per_call: dict[str, list[float]] = {name: [] for name in sides}
    per_round: dict[str, list[float]] = {name: [] for name in sides}
    clock = time.perf_counter
    names = list(sides)
    for _ in range(reps):
        totals = dict.fromkeys(names, 0.0)
        for call in range(calls):
            for name in names if call % 2 == 0 else names[::-1]:
                t0 = clock()
                sides[name]()
                elapsed = clock() - t0
                totals[name] += elapsed
                per_call[name].append(elapsed)
        for name in names:
            per_round[name].append(calls * nbytes / totals[name] / GB)
    for tensor in device.kv_tensors:  # what the host holds must load back bit-exact
        tensor.view(torch.uint8).zero_()
    io.load(host, device, host_pages, slots)
    for now, before in zip(device.kv_tensors, original, strict=True):
        if not torch.equal(now.view(torch.uint8), before.view(torch.uint8)):
            raise SystemExit(f"{spec.name} {layout.value} {pattern}: load did not round-trip")
    ratios = [lo / bk for lo, bk in zip(per_round["load"], per_round["backup"], strict=True)]
    timing = {
        name: {
            "p50_ms": round(percentile(per_call[name], 50) * 1e3, 3),
            "p99_ms": round(percentile(per_call[name], 99) * 1e3, 3),
        }
        for name in ("load", "backup")
    }
    for t in timing.values():
        t["p99_over_p50"] = round(t["p99_ms"] / t["p50_ms"], 2) if t["p50_ms"] else None
    line = {
        "bench": BENCH,
        "case": f"load vs backup {pages}x{geometry.bytes_per_page >> 20}MiB "
        f"{spec.name} {layout.value} {pattern}",
        "ours": round(statistics.median(per_round["load"]), 3),
        "baseline": round(statistics.median(per_round["backup"]), 3),
        "baseline_name": "backup (device -> host), same pages and slots",
        "unit": "GB/s",
        "ratio": round(statistics.median(ratios), 3),
        "target": LOAD_TARGET,
        "spread": [round(min(ratios), 3), round(max(ratios), 3)],
        "load": timing["load"],
        "backup": timing["backup"],
        "p99_target": P99_TARGET,
        "load_gbps_spread": [round(min(per_round["load"]), 3), round(max(per_round["load"]), 3)],
        "backup_gbps_spread": [
            round(min(per_round["backup"]), 3),
            round(max(per_round["backup"]), 3),
        ],
        "copy_gbps": round(statistics.median(per_round["copy_"]), 3),
        "calls": calls * reps,
    }
    print(json.dumps(line), flush=True)
    lo, bk = timing["load"], timing["backup"]
    flag = "" if line["ratio"] >= LOAD_TARGET else "  LOAD BELOW TARGET"
    if (lo["p99_over_p50"] or 0) >= P99_TARGET:
        flag += "  LOAD P99 >= 2x P50"
    print(
        f"{spec.name:<7}{layout.value:<18}{pattern:<11}"
        f"load {line['ours']:6.2f} [{line['load_gbps_spread'][0]:.2f}-"
        f"{line['load_gbps_spread'][1]:.2f}] p50/p99 {lo['p50_ms']:7.1f}/{lo['p99_ms']:7.1f} ms  "
        f"backup {line['baseline']:6.2f} [{line['backup_gbps_spread'][0]:.2f}-"
        f"{line['backup_gbps_spread'][1]:.2f}] p50/p99 {bk['p50_ms']:7.1f}/{bk['p99_ms']:7.1f} "
        f"ms  x{line['ratio']} [{line['spread'][0]}-{line['spread'][1]}]  "
        f"copy_ {line['copy_gbps']:.2f}{flag}",
        file=sys.stderr,
        flush=True,
    )
    return line


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 pages, 4 calls x 3 rounds")
    parser.add_argument("--pages", type=int, default=None, help="pages per call (default 64)")
    parser.add_argument("--calls", type=int, default=None, help="calls per round (default 8)")
    parser.add_argument("--reps", type=int, default=None, help="timed rounds (default 5)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--io-backends", default="direct,kernel")
    parser.add_argument("--layouts", default=",".join(layout.value for layout in Layout))
    parser.add_argument("--slots", default=",".join(PATTERNS), help="slot patterns")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    pages = args.pages or (16 if args.quick else 64)
    calls = args.calls or (4 if args.quick else 8)
    reps = args.reps or (3 if args.quick else 5)
    geometry = KVGeometry.mha(
        num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", page_size=64
    )
    print(
        f"{BENCH}: {pages} x {geometry.bytes_per_page >> 20} MiB pages per call, {calls} calls "
        f"x {reps} rounds per side, torch threads {torch.get_num_threads()}, device cpu",
        file=sys.stderr,
    )
    for name in args.io_backends.split(","):
        spec = SPECS[name]
        for layout_name in args.layouts.split(","):
            layout = Layout(layout_name)
            for pattern in args.slots.split(","):
                if pattern not in PATTERNS:
                    raise SystemExit(f"unknown slot pattern {pattern!r}; choose from {PATTERNS}")
                if pattern == "tokens" and name == "direct":
                    continue  # direct moves whole device pages only
                one_case(spec, layout, pattern, geometry, pages, calls, reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
