"""Host <-> device speed of each IO backend and host-pool layout, next to a raw ``copy_``.

An 8B-class geometry (32 layers, 8 KV heads, head dim 128, bf16, vLLM's 16-token pages,
2 MiB per page). For each IO backend (``direct``, ``kernel``) and layout: backup and load,
all layers at once and layer by layer, of every page of a device pool, the device pages
in random order (as a vLLM block table holds them) and the host pages in random order.
The pieces are built as an engine adapter builds them: ``resolve`` a config, then
``build_io_backend`` and ``build_host_pool`` from the plan.

The baseline is the raw limit: one ``copy_`` of a contiguous buffer of the same number of
bytes between pinned host memory and the device (``non_blocking`` and a synchronize; on
the CPU, where nothing pins, a plain ``copy_``), measured in the same process, interleaved
with ours (ABBA), after a warm-up, as the median of several repetitions; ``ratio`` is the
median of the paired per-repetition ratios. After the timings every pair's round trip is
checked byte for byte (random device bytes, backup, device zeroed, load, compare):
``wrong_bytes`` must be 0. One JSON line per case on stdout, one ``best`` line per
operation (target 0.8 x copy_) and one ``summary`` line; a table on stderr.

    python benchmarks/gpu.py [--quick] [--device cuda|cpu] [--pages N] [--reps N]
                             [--io direct,kernel] [--layouts a,b]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("KVTIER_DISABLE_PLUGIN_AUTOLOAD", "1")  # built-ins only, measured
if importlib.util.find_spec("kvtier") is None:  # run from a checkout, not installed
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from _device import emit, pick_device

from kvtier.adapters import build_host_pool, build_io_backend, resolve
from kvtier.core.config import EngineConfig
from kvtier.core.device_pool import TorchDevicePool
from kvtier.core.geometry import AttentionKind
from kvtier.core.layout import Layout
from kvtier.core.specs import Operation
from kvtier.plugins.manager import default_registry

TARGET = 0.8
IO_BACKENDS = ("direct", "kernel")
LAYOUTS = tuple(layout.value for layout in Layout)
OPERATIONS = (
    Operation.BACKUP_ALL,
    Operation.LOAD_ALL,
    Operation.BACKUP_LAYER,
    Operation.LOAD_LAYER,
)


@dataclass(frozen=True)
class Shape:
    """The geometry measured: layers, KV heads, head dim, tokens per page, pages moved."""

    layers: int
    heads: int
    head_dim: int
    page_size: int
    pages: int


FULL = Shape(layers=32, heads=8, head_dim=128, page_size=16, pages=512)  # 1 GiB
QUICK = Shape(layers=4, heads=2, head_dim=64, page_size=16, pages=8)  # 256 KiB


def synchronizer(device: torch.device) -> Callable[[], None]:
    """A call that waits for the device's queued work (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def timed(fn: Callable[[], Any], sync: Callable[[], None]) -> float:
    """Seconds ``fn`` takes, the device drained before and after."""
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def abba(
    ours: Callable[[], Any], base: Callable[[], Any], reps: int, sync: Callable[[], None]
) -> tuple[list[float], list[float]]:
    """Per-repetition seconds of ours and of the baseline: one warm-up each, then ABBA.

    Alternating which side goes first makes slow drifts (clocks, other jobs) land on both
    sides alike instead of on one.
    """
    ours()
    base()
    mine: list[float] = []
    theirs: list[float] = []
    for rep in range(reps):
        if rep % 2:
            theirs.append(timed(base, sync))
            mine.append(timed(ours, sync))
        else:
            mine.append(timed(ours, sync))
            theirs.append(timed(base, sync))
    return mine, theirs


class RawCopy:
    """The raw limit: one ``copy_`` of ``nbytes`` between pinned host memory and the device."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.host.fill_(1)  # touched once, like the host pool's pages
        self.device = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.non_blocking = pin
        self.name = "tensor.copy_ " + ("pinned, non_blocking" if pin else "(CPU, not pinned)")

    def run(self, to_host: bool) -> Callable[[], None]:
        """The copy in one direction (to the host for backups, to the device for loads)."""
        host, dev, nb = self.host, self.device, self.non_blocking

        def copy() -> None:
            (host.copy_(dev, non_blocking=nb) if to_host else dev.copy_(host, non_blocking=nb))

        return copy


def plan_for(shape: Shape, io: str, layout: str) -> Any:
    """The resolved plan of (io, layout) with every operation the pair supports, or None."""
    registry = default_registry()
    spec = registry.io_backends.get(io)
    if spec is None:
        raise SystemExit(
            f"--io: {io!r} is not an IO backend here; have {sorted(registry.io_backends)}"
        )
    ops = [op for op in OPERATIONS if spec.supports(Layout(layout), AttentionKind.MHA, op)]
    if not ops:
        return None
    config = EngineConfig.model_validate(
        {
            "backend": "memory",
            "io_backend": io,
            "layout": layout,
            "num_layers": shape.layers,
            "num_kv_heads": shape.heads,
            "head_dim": shape.head_dim,
            "dtype": "bfloat16",
            "page_size": shape.page_size,
            "operations": [op.value for op in ops],
            "host_pages": shape.pages,
        }
    )
    return resolve(config, registry.backends, registry.io_backends)


def wrong_bytes(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> int:
    """Bytes that differ between two tuples of same-shaped tensors (compared raw)."""
    return sum(
        int((x.view(torch.uint8) != y.view(torch.uint8)).sum().item())
        for x, y in zip(a, b, strict=True)
    )


def fill_random(dev: TorchDevicePool, seed: int) -> None:
    """Random bytes in every device buffer (NaN patterns included), drawn on the device
    itself: a gigabyte drawn on the CPU and copied over takes seconds."""
    gen = torch.Generator(device=dev.device).manual_seed(seed)
    for tensor in dev.kv_tensors:
        tensor.view(torch.uint8).random_(0, 256, generator=gen)


def round_trip(
    io: Any,
    dev: TorchDevicePool,
    host: Any,
    slots: torch.Tensor,
    pages: list[int],
    per_layer: bool,
    seed: int,
) -> int:
    """Fresh random device bytes, backup, zero both sides, load back: bytes that differ."""
    fill_random(dev, seed)
    expected = tuple(t.clone() for t in dev.kv_tensors)
    host.zero_()
    layers: list[int | None] = list(range(dev.geometry.num_layers)) if per_layer else [None]
    for layer in layers:
        io.backup(dev, host, slots, pages, layer=layer)
    dev.zero_()
    for layer in layers:
        io.load(host, dev, pages, slots, layer=layer)
    if dev.device.type == "cuda":
        torch.cuda.synchronize(dev.device)
    return wrong_bytes(expected, dev.kv_tensors)


def operations(
    io: Any, dev: TorchDevicePool, host: Any, slots: torch.Tensor, pages: list[int]
) -> dict[Operation, Callable[[], None]]:
    """Each operation over every page: all layers in one call, or one call per layer."""
    layers = range(dev.geometry.num_layers)

    def backup_all() -> None:
        io.backup(dev, host, slots, pages)

    def load_all() -> None:
        io.load(host, dev, pages, slots)

    def backup_layer() -> None:
        for layer in layers:
            io.backup(dev, host, slots, pages, layer=layer)

    def load_layer() -> None:
        for layer in layers:
            io.load(host, dev, pages, slots, layer=layer)

    return {
        Operation.BACKUP_ALL: backup_all,
        Operation.LOAD_ALL: load_all,
        Operation.BACKUP_LAYER: backup_layer,
        Operation.LOAD_LAYER: load_layer,
    }


def measure_pair(
    plan: Any,
    dev: TorchDevicePool,
    host: Any,
    slots: torch.Tensor,
    pages: list[int],
    raw: RawCopy,
    reps: int,
    sync: Callable[[], None],
) -> list[dict[str, Any]]:
    """The timed operations of one (IO backend, layout) plan, then its round-trip checks:
    one record per operation (``case`` and ``device`` left to the caller)."""
    io = build_io_backend(plan)
    total = slots.numel() // plan.geometry.page_size * plan.geometry.bytes_per_page
    timings: dict[Operation, tuple[list[float], list[float]]] = {}
    for op, ours in operations(io, dev, host, slots, pages).items():
        if op in plan.operations:
            to_host = op in (Operation.BACKUP_ALL, Operation.BACKUP_LAYER)
            timings[op] = abba(ours, raw.run(to_host), reps, sync)
    wrong: dict[bool, int] = {}
    for per_layer, pair in (
        (False, (Operation.BACKUP_ALL, Operation.LOAD_ALL)),
        (True, (Operation.BACKUP_LAYER, Operation.LOAD_LAYER)),
    ):
        whole = all(op in plan.operations for op in pair)
        # a pair the plan lacks half of is checked through the other pair
        wrong[per_layer] = round_trip(io, dev, host, slots, pages, per_layer == whole, 2)
    records = []
    for op, (mine, theirs) in timings.items():
        per_layer = op in (Operation.BACKUP_LAYER, Operation.LOAD_LAYER)
        records.append(
            {
                "bench": "gpu",
                "case": "",
                "ours": round(total / statistics.median(mine) / 1e9, 3),
                "baseline": round(total / statistics.median(theirs) / 1e9, 3),
                "baseline_name": raw.name,
                "unit": "GB/s",
                "ratio": round(
                    statistics.median(b / o for o, b in zip(mine, theirs, strict=True)), 3
                ),
                "target": None,
                "op": op.value,
                "io": plan.io_backend.name,
                "layout": plan.layout.value,
                "bytes": total,
                "wrong_bytes": wrong[per_layer],
            }
        )
    return records


def main(argv: list[str] | None = None) -> int:
    """Run every (IO backend, layout, operation) case; print the JSON lines. 1 on wrong bytes."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 small layers, 8 pages, 3 reps")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if any)")
    parser.add_argument("--pages", type=int, default=None, help="pages moved (default 512)")
    parser.add_argument("--reps", type=int, default=None, help="repetitions (default 9)")
    parser.add_argument("--io", default=",".join(IO_BACKENDS), help="IO backends, comma list")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="layouts, comma list")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    args = parser.parse_args(argv)
    device = pick_device(args.device)
    base_shape = QUICK if args.quick else FULL
    shape = Shape(
        base_shape.layers,
        base_shape.heads,
        base_shape.head_dim,
        base_shape.page_size,
        args.pages or base_shape.pages,
    )
    if shape.pages <= 0:
        raise SystemExit(f"--pages: must be positive, got {shape.pages}")
    reps = args.reps or (3 if args.quick else 9)
    layouts = [x for x in args.layouts.split(",") if x]
    unknown = sorted(set(layouts) - set(LAYOUTS))
    if unknown:
        raise SystemExit(f"--layouts: unknown {unknown}; choose from {list(LAYOUTS)}")
    torch.set_num_threads(args.threads)
    sync = synchronizer(device)

    ps = shape.page_size
    gen = torch.Generator().manual_seed(0)
    first = plan_for(shape, args.io.split(",")[0], layouts[0])
    geometry = first.geometry
    dev = TorchDevicePool(geometry, shape.pages * ps, device)
    fill_random(dev, 0)
    device_pages = torch.randperm(shape.pages, generator=gen)
    slots = (device_pages[:, None] * ps + torch.arange(ps)).reshape(-1).to(device)
    total = shape.pages * geometry.bytes_per_page
    raw = RawCopy(total, device)
    page = geometry.bytes_per_page
    label = f"{shape.pages}x" + (f"{page >> 20}MiB" if page >= 1 << 20 else f"{page >> 10}KiB")
    print(
        f"gpu: {geometry.describe()}, {label} = {total / 2**20:.0f} MiB on {device}, "
        f"{reps} reps; baseline {raw.name}",
        file=sys.stderr,
    )
    print(f"{'case':52s} {'ours':>8s} {'copy_':>8s} {'ratio':>6s} wrong", file=sys.stderr)

    results: list[dict[str, Any]] = []
    failures: list[str] = []
    for layout in layouts:
        host: Any = None
        for io_name in [x for x in args.io.split(",") if x]:
            plan = plan_for(shape, io_name, layout)
            if plan is None:
                print(f"{io_name} {layout}: no operation supported, skipped", file=sys.stderr)
                continue
            if host is None:
                host = build_host_pool(plan, num_pages=shape.pages)
            pages = torch.randperm(shape.pages, generator=gen).tolist()  # host pages
            try:
                records = measure_pair(plan, dev, host, slots, pages, raw, reps, sync)
            except Exception as exc:  # one broken pair must not hide the others' numbers
                failures.append(f"{io_name} {layout}: {exc!r}")
                emit(
                    {"bench": "gpu", "case": f"error {layout} {io_name}", "error": repr(exc)},
                    f"{io_name} {layout}: FAILED {exc!r}",
                )
                continue
            for record in records:
                record["case"] = f"{record['op']} {layout} {io_name} {label}"
                record["device"] = str(device)
                results.append(record)
                emit(
                    record,
                    f"{record['case']:52s} {record['ours']:8.2f} {record['baseline']:8.2f} "
                    f"{record['ratio']:6.2f} {record['wrong_bytes']}",
                )
        del host

    best: dict[str, Any] = {}
    for op in OPERATIONS:
        mine_ = [r for r in results if r["op"] == op.value]
        if not mine_:
            continue
        top = max(mine_, key=lambda r: float(r["ratio"]))
        record = {**top, "case": f"best {op.value}: {top['case']}", "target": TARGET}
        best[op.value] = {"ratio": top["ratio"], "case": top["case"], "ok": top["ratio"] >= TARGET}
        emit(record, f"{record['case']:52s} ratio {top['ratio']} (target {TARGET})")
    total_wrong = sum(int(r["wrong_bytes"]) for r in results)
    summary = {
        "bench": "gpu",
        "case": "summary",
        "device": str(device),
        "target": TARGET,
        "best": best,
        "cases": len(results),
        "wrong_bytes": total_wrong,
        "all_best_ok": bool(best) and all(b["ok"] for b in best.values()),
        "errors": failures,
    }
    emit(summary, f"summary: {len(results)} cases, wrong bytes {total_wrong}")
    return 1 if total_wrong or failures or not results else 0


if __name__ == "__main__":
    sys.exit(main())
