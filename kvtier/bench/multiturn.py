"""The ``multiturn`` workload: simulated conversations through TieredCache.

Several conversations share a system prompt and take turns, the way a chat server
interleaves them. Each turn is one engine step over the conversation's whole history:
prefetch the cached prefix (host pool, then storage), load it into device slots, check
every loaded byte against what its page key stands for, "compute" the pages that were
not cached (deterministic KV per key) and back them up (device -> host -> storage). The
host pool is smaller than the working set, so older turns come back from storage.

The report gives the hit rate per tier (host, storage, recomputed), bytes moved per
direction, throughput, and the cache's failure counters; ``--json`` prints it as one JSON
object, ``--plot FILE.png`` draws throughput and hit rates over the run (matplotlib).
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any

import torch

from kvtier.bench.checks import (
    PLOT_HINT,
    check_device_runs,
    check_memory,
    check_plot,
    check_seed,
    make_workdir,
    resolve_device,
)
from kvtier.bench.options import (
    GB,
    backend_names,
    chain_options,
    check_workload_options,
    engine_config,
    temporary_root,
    temporary_tier_roots,
)
from kvtier.bench.progress import Progress
from kvtier.cache import TieredCache
from kvtier.core.capabilities import resolve
from kvtier.core.device_pool import TorchDevicePool
from kvtier.core.envelope import ENVELOPE_BYTES
from kvtier.core.errors import InvalidFieldError
from kvtier.core.extra_config import parse_extra_config
from kvtier.core.layout import region_stride_bytes
from kvtier.testing.content import check_pages, fill_pages

if TYPE_CHECKING:
    from kvtier.plugins.registry import Registry

__all__ = ["MultiturnResult", "add_arguments", "run_multiturn"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the multiturn workload's own options (``kvtier bench`` adds the shared ones)."""
    group = parser.add_argument_group("multiturn workload (--workload multiturn)")
    group.add_argument("--conversations", type=int, default=8, help="default 8")
    group.add_argument("--turns", type=int, default=4, help="turns per conversation; default 4")
    group.add_argument(
        "--system-tokens", type=int, default=256, help="shared system prompt; default 256"
    )
    group.add_argument(
        "--turn-tokens", type=int, default=256, help="tokens each turn adds; default 256"
    )
    group.add_argument(
        "--host-pages",
        type=int,
        default=None,
        help="host pool pages (default: a quarter of the working set, at least two "
        "conversations, so storage is used)",
    )
    group.add_argument(
        "--write-policy",
        choices=("write_through", "write_through_selective", "write_back"),
        default="write_through",
    )
    group.add_argument(
        "--prefetch-policy",
        choices=("best_effort", "wait_complete", "timeout"),
        default="wait_complete",
    )
    group.add_argument(
        "--plot",
        default=None,
        metavar="FILE.png",
        help="multiturn only: draw throughput and hit rates per turn into a PNG (needs "
        f"matplotlib: {PLOT_HINT}); the file is checked writable before the run",
    )


@dataclass
class Step:
    """One turn of one conversation."""

    seconds: float
    pages: int
    host: int
    storage: int
    computed: int
    bytes_moved: int


@dataclass
class MultiturnResult:
    """What the run measured; ``ok`` is False if any loaded page differed."""

    plan: dict[str, Any]
    steps: list[Step] = field(default_factory=list)
    mismatched_pages: int = 0
    #: wall time of the whole run, simulation (KV fill, byte checks) included
    seconds: float = 0.0
    #: waiting for writes still queued after the last turn
    flush_seconds: float = 0.0
    stats: dict[str, Any] = field(default_factory=dict)
    #: what the run did besides measuring (the plot it wrote, or why it could not)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.mismatched_pages == 0

    @property
    def cache_seconds(self) -> float:
        """Time spent in cache calls (prefetch, load, backup to host) plus the final flush."""
        return sum(s.seconds for s in self.steps) + self.flush_seconds

    def to_dict(self) -> dict[str, Any]:
        """The JSON report."""
        pages = sum(s.pages for s in self.steps)
        host = sum(s.host for s in self.steps)
        storage = sum(s.storage for s in self.steps)
        computed = sum(s.computed for s in self.steps)
        moved = self.stats.get("bytes", {})
        total = sum(moved.values())
        return {
            "workload": "multiturn",
            "ok": self.ok,
            "plan": self.plan,
            "turns": len(self.steps),
            "pages": pages,
            "hit_rate": {
                "host": round(host / pages, 4) if pages else 0.0,
                "storage": round(storage / pages, 4) if pages else 0.0,
                "recomputed": round(computed / pages, 4) if pages else 0.0,
            },
            "bytes": moved,
            "seconds": round(self.seconds, 3),
            "cache_seconds": round(self.cache_seconds, 3),
            "throughput_gbps": round(total / self.cache_seconds / GB, 3)
            if self.cache_seconds
            else 0.0,
            "pages_per_s": round(pages / self.cache_seconds, 1) if self.cache_seconds else 0.0,
            "mismatched_pages": self.mismatched_pages,
            "notes": list(self.notes),
            "failures": self.stats.get("failures", {}),
            "latency_p50_ms": {
                op: None if h["p50"] is None else round(h["p50"] * 1e3, 3)
                for op, h in self.stats.get("latency_seconds", {}).items()
            },
        }

    def report(self) -> str:
        """A human-readable summary."""
        d = self.to_dict()
        rate = d["hit_rate"]
        lines = [
            f"multiturn: {d['turns']} turns, {d['pages']} pages requested, "
            f"{d['seconds']} s, {d['cache_seconds']} s in cache calls "
            f"({'OK: every loaded byte matched' if d['ok'] else 'MISMATCH'})",
            f"  plan        {d['plan']['backend']} / {d['plan']['io_backend']} / "
            f"{d['plan']['layout']}, {d['plan']['host_pages']} host pages, "
            f"{d['plan']['write_policy']}, {d['plan']['prefetch_policy']}",
            f"  hit rate    host {rate['host']:.1%}  storage {rate['storage']:.1%}  "
            f"recomputed {rate['recomputed']:.1%}",
            "  bytes       " + "  ".join(f"{k} {v / GB:.3f} GB" for k, v in d["bytes"].items()),
            f"  throughput  {d['throughput_gbps']} GB/s moved, {d['pages_per_s']} pages/s "
            "(over time in cache calls)",
        ]
        if d["failures"]:
            lines.append(f"  failures    {d['failures']}")
        if d["mismatched_pages"]:
            lines.append(f"  MISMATCHED  {d['mismatched_pages']} loaded pages differed")
        lines += [f"  note: {n}" for n in d["notes"]]
        return "\n".join(lines)


def _histories(args: argparse.Namespace, seed: int) -> list[list[list[int]]]:
    """Per conversation, the token history at each turn (all share the system prompt)."""
    rng = random.Random(seed)
    system = [rng.randrange(0, 32_000) for _ in range(args.system_tokens)]
    out = []
    for _ in range(args.conversations):
        history = list(system)
        turns = []
        for _ in range(args.turns):
            history = history + [rng.randrange(0, 32_000) for _ in range(args.turn_tokens)]
            turns.append(list(history))
        out.append(turns)
    return out


def run_multiturn(
    args: argparse.Namespace,
    *,
    registry: Registry | None = None,
    progress_stream: IO[str] | None = None,
) -> MultiturnResult:
    """Open a TieredCache for the options, run the conversations, return the measurements."""
    check_workload_options(args, "multiturn")
    for name in ("conversations", "turns", "turn_tokens"):
        value = getattr(args, name)
        if value <= 0:
            flag = "--" + name.replace("_", "-")
            raise InvalidFieldError(flag, f"must be a positive integer, got {value}", value=value)
    if args.system_tokens < 0:
        raise InvalidFieldError(
            "--system-tokens",
            f"must be 0 or more, got {args.system_tokens}",
            value=args.system_tokens,
        )
    if args.host_pages is not None and args.host_pages <= 0:
        raise InvalidFieldError(
            "--host-pages",
            f"must be a positive integer, got {args.host_pages}; leave it out for the default "
            "(a quarter of the working set)",
            value=args.host_pages,
        )
    check_seed(args.seed)
    check_plot(args.plot, "multiturn")
    device_name = resolve_device(args.device)
    if registry is None:
        from kvtier.plugins.manager import load_registry

        registry = load_registry()
    ps = args.page_size
    max_pages = (args.system_tokens + args.turns * args.turn_tokens) // ps
    working_set = (args.system_tokens + args.conversations * args.turns * args.turn_tokens) // ps
    # room for one turn's prefetch plus the writes still in flight from the previous one
    host_pages = (
        args.host_pages if args.host_pages is not None else max(2 * max_pages + 2, working_set // 4)
    )
    extra = parse_extra_config(args.extra_config, source="--extra-config")
    workdir = make_workdir(args.workdir, "kvtier-multiturn-")
    try:
        chain = chain_options(args)
        names = backend_names(args, "multiturn", chain)
        if names:
            extra = temporary_root(registry, names[0], extra, workdir)
        else:
            chain, _ = temporary_tier_roots(registry, chain, workdir)
        config = engine_config(
            args,
            extra,
            backend=names[0] if names else None,
            chain=chain,
            model="kvtier-bench-multiturn",
            host_pages=host_pages,
        )
        geometry = config.geometry()
        resolved = resolve(
            config, registry.backends, registry.io_backends, policies=registry.policies
        )
        check_device_runs(device_name, resolved.io_backend.name, resolved.io_backend.devices)
        stored = geometry.kv_count * region_stride_bytes(geometry, resolved.layout) + ENVELOPE_BYTES
        check_memory(
            host_pages * stored,
            max(max_pages, 1) * geometry.bytes_per_page,
            device_name,
            what="the host pool and the device pool",
            fix="use fewer --host-pages, shorter conversations (--turns, --turn-tokens, "
            "--system-tokens) or a smaller geometry",
        )
        device = TorchDevicePool(geometry, max(max_pages, 1) * ps, device_name)
        options = {
            "write_policy": args.write_policy,
            "prefetch_policy": args.prefetch_policy,
        }
        cache = TieredCache.open(resolved, device, options=options)  # resolved once, above
        try:
            result = _drive(args, cache, progress_stream or sys.stderr)
        finally:
            cache.close()
        result.stats = cache.stats()
        if args.plot:
            try:
                _plot(result, args.plot)
            except OSError as exc:  # checked writable before the run; the disk may have filled
                result.notes.append(f"could not write the plot {args.plot}: {exc}")
            else:
                result.notes.append(f"plot written to {args.plot}")
        return result
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _drive(args: argparse.Namespace, cache: TieredCache, stream: IO[str]) -> MultiturnResult:
    ps = cache.geometry.page_size
    plan = cache.plan
    result = MultiturnResult(
        plan={
            "backend": plan.backend.name,
            "io_backend": plan.io_backend.name,
            "layout": plan.layout.value,
            "geometry": plan.geometry.describe(),
            "host_pages": cache.host_pool.num_pages,
            "conversations": args.conversations,
            "turns": args.turns,
            "write_policy": cache.options.write_policy,
            "prefetch_policy": cache.options.prefetch_policy,
        }
    )
    histories = _histories(args, args.seed)
    progress = Progress(
        args.conversations * args.turns,
        stream,
        not args.no_progress,
        title="  multiturn ",
        unit="turns",
    )
    page_bytes = cache.geometry.bytes_per_page
    started = time.perf_counter()
    try:
        for turn in range(args.turns):
            for conversation in histories:
                step = _turn(cache, conversation[turn], ps, result)
                step.bytes_moved *= page_bytes
                result.steps.append(step)
                progress.step(f"{step.pages} pages, {step.host} host, {step.storage} storage")
        t0 = time.perf_counter()
        cache.flush(60.0)
        result.flush_seconds = time.perf_counter() - t0
    finally:
        progress.close()
    result.seconds = time.perf_counter() - started
    return result


def _turn(cache: TieredCache, tokens: Sequence[int], ps: int, result: MultiturnResult) -> Step:
    """One engine step over a conversation's history; only cache calls are timed."""
    keys = cache.keys(list(tokens))
    slots = torch.arange(len(keys) * ps, dtype=torch.int64)
    t0 = time.perf_counter()
    handle = cache.prefetch(keys)
    host = handle.host_hits
    loaded = cache.load(handle, slots)
    elapsed = time.perf_counter() - t0
    host = min(host, loaded)
    storage = loaded - host
    bad = check_pages(cache.device_pool, keys[:loaded], slots[: loaded * ps])
    result.mismatched_pages += bad.count(False)
    new = keys[loaded:]
    if new:
        fill_pages(cache.device_pool, new, slots[loaded * ps :])  # the "forward pass"
        t1 = time.perf_counter()
        backup = cache.backup(new, slots[loaded * ps :])
        backup.wait_host(60.0)
        elapsed += time.perf_counter() - t1
    moved = loaded + len(new) + storage + (len(new) if cache.writes_storage else 0)
    return Step(elapsed, len(keys), host, storage, len(new), moved)


def _plot(result: MultiturnResult, path: str) -> None:
    """Throughput and cumulative hit rates per step, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = result.steps
    x = list(range(1, len(steps) + 1))
    gbps = [s.bytes_moved / s.seconds / GB if s.seconds else 0.0 for s in steps]
    seen = host = storage = 0
    host_rate, storage_rate = [], []
    for s in steps:
        seen += s.pages
        host += s.host
        storage += s.storage
        host_rate.append(host / seen if seen else 0.0)
        storage_rate.append(storage / seen if seen else 0.0)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    top.plot(x, gbps, label="GB/s moved")
    top.set_ylabel("GB/s")
    top.set_title("kvtier bench --workload multiturn")
    top.legend()
    bottom.plot(x, host_rate, label="host hit rate (cumulative)")
    bottom.plot(x, storage_rate, label="storage hit rate (cumulative)")
    bottom.set_xlabel("turn (all conversations)")
    bottom.set_ylim(0, 1)
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
