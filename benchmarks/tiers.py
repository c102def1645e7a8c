"""A request trace through TieredCache on a small file tier over Mooncake, beside each alone.

    python benchmarks/tiers.py [--quick] [--trace FILE] [--requests N] [--file-fraction F]

Replays the first requests of a trace (default: ``../shared/traces/mooncake_fast25_
synthetic_trace.jsonl``; one JSON object a line with ``hash_ids``, one id per 512-token
block) through a real :class:`~kvtier.cache.TieredCache` three ways, in one run: a small
file tier (``--file-fraction`` of the distinct blocks, the file backend's own capacity)
over Mooncake (the whole working set), the file tier alone, and Mooncake alone. Each
block id is one page of ``page_size`` tokens (token ids derived from the id, so equal ids
at equal positions chain into equal page keys: shared prefixes are shared pages). A
request prefetches its blocks, loads the prefix found, then backs up the rest, as an
engine would; the host pool is small, so hits come from the tiers. Every loaded page is
checked against the content its key must have. Printed per configuration: the prefix
hit ratio (token-weighted, as benchmarks/policies.py counts it), bytes read per tier,
and each tier's median latency per page (every page a tier was asked for counts once,
at its get call's time over the pages of that call), beside the mean get call, as JSON
lines (DESIGN.md's benchmark form; ``ratio`` is the hit ratio against the file tier
alone's).
Starts its own ``mooncake_master`` on loopback.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# benchmarks/mooncake.py would shadow the mooncake package: keep this directory off the path
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import torch  # noqa: E402

from kvtier.cache import TieredCache  # noqa: E402
from kvtier.core.config import load_engine_config  # noqa: E402
from kvtier.core.device_pool import TorchDevicePool  # noqa: E402
from kvtier.testing.content import check_pages, fill_pages  # noqa: E402
from kvtier.testing.mooncake import MooncakeMaster, mooncake_unavailable_reason, use_client_env  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared" / "traces" / "mooncake_fast25_synthetic_trace.jsonl"
PAGE = 16
GEOMETRY = {
    "num_layers": 4,
    "num_kv_heads": 2,
    "head_dim": 64,
    "dtype": "bfloat16",
    "page_size": PAGE,
}
JOIN = 60.0


def _requests(path: Path, count: int, cap: int) -> list[tuple[list[int], list[int]]]:
    """(block ids, tokens per block) of the first ``count`` requests, at most ``cap`` blocks."""
    out: list[tuple[list[int], list[int]]] = []
    with open(path) as handle:
        for line in handle:
            if len(out) == count:
                break
            entry = json.loads(line)
            ids = entry["hash_ids"][:cap]
            last = entry["input_length"] - 512 * (len(entry["hash_ids"]) - 1)
            weights = [512] * len(ids)
            if len(ids) == len(entry["hash_ids"]):
                weights[-1] = max(0, min(512, last))
            out.append((ids, weights))
    return out


def _tokens(ids: list[int]) -> list[int]:
    return [bid * PAGE + j for bid in ids for j in range(PAGE)]


def _time_gets(cache: TieredCache) -> dict[str, list[float]]:
    """Record, per tier, the seconds per page of every get the chain asks of it (the
    engine's reads, not the chain's own staging reads), each page once."""
    samples: dict[str, list[float]] = {}
    for tier in cache.page_store.tiers:
        out = samples[tier.name] = []
        get = tier.store.get

        def timed(
            keys: Any, pages: Any, *, _get: Any = get, _out: list[float] = out, **more: Any
        ) -> Any:
            t0 = time.perf_counter()
            result = _get(keys, pages, **more)
            if keys:
                _out.extend([(time.perf_counter() - t0) / len(keys)] * len(keys))
            return result

        tier.store.get = timed  # type: ignore[method-assign]
    return samples


def _replay(cache: TieredCache, requests: list[tuple[list[int], list[int]]]) -> dict[str, Any]:
    ps = cache.geometry.page_size
    per_page = _time_gets(cache)
    device = cache.device_pool
    hit_tokens = total_tokens = 0
    for ids, weights in requests:
        keys = cache.keys(_tokens(ids))
        where = torch.arange(len(keys) * ps)
        handle = cache.prefetch(keys)
        handle.wait(JOIN)
        loaded = cache.load(handle, where)
        if loaded and not all(check_pages(device, keys[:loaded], where[: loaded * ps])):
            raise SystemExit("a loaded page does not hold its key's content")
        hit_tokens += sum(weights[:loaded])
        total_tokens += sum(weights)
        rest = keys[loaded:]
        if rest:
            slots = where[loaded * ps :]
            fill_pages(device, rest, slots)
            backup = cache.backup(rest, slots)
            backup.wait_host(JOIN)
    cache.flush(JOIN)
    cache.page_store.flush(JOIN)
    tiers = cache.stats()["tiers"]
    return {
        "hit_ratio": hit_tokens / total_tokens if total_tokens else 0.0,
        "tiers": [
            {
                "tier": t["name"],
                "bytes_read": t["store"]["bytes_read"],
                "hits": t["store"]["hits"],
                "get_ms_per_page_median": 1e3 * statistics.median(per_page[t["name"]])
                if per_page[t["name"]]
                else None,
                "get_ms_per_call_mean": 1e3 * t["get_seconds"] / t["get_calls"]
                if t["get_calls"]
                else None,
                "promotions": t["promotions"],
                "cascades": t["cascades"],
                "drops": t["drops"],
            }
            for t in tiers
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--file-fraction", type=float, default=0.1)
    args = parser.parse_args()
    reason = mooncake_unavailable_reason()
    if reason is not None:
        raise SystemExit(f"benchmarks/tiers.py needs Mooncake: {reason}")
    count = args.requests or (400 if args.quick else 1200)
    cap = 24 if args.quick else 48
    requests = _requests(args.trace, count, cap=cap)
    distinct = len({bid for ids, _ in requests for bid in ids})
    config = load_engine_config({**GEOMETRY, "backend": "memory"})
    page_bytes = config.geometry().bytes_per_page + 4096
    file_capacity = max(8, int(args.file_fraction * distinct)) * page_bytes
    use_client_env()
    master = MooncakeMaster(storage_node_bytes=max(64 << 20, 4 * distinct * page_bytes)).start()
    results: dict[str, Any] = {}
    try:
        with tempfile.TemporaryDirectory(dir=ROOT.parent) as tmp:

            def file_tier(name: str) -> dict[str, Any]:
                return {
                    "backend": "file",
                    "extra_config": {
                        "root": f"{tmp}/{name}",
                        "capacity_bytes": file_capacity,
                        "min_free_bytes": 0,
                    },
                }

            mooncake = {
                "backend": "mooncake",
                "extra_config": {"master_address": master.address, "global_segment_size": 0},
            }
            setups = {
                "file over mooncake": [file_tier("chain"), mooncake],
                "file alone": [file_tier("alone")],
                "mooncake alone": [mooncake],
            }
            for name, tiers in setups.items():
                engine = load_engine_config(
                    {
                        **GEOMETRY,
                        "tiers": tiers,
                        "host_pages": 2 * cap + 8,
                        "model": f"bench-{name}",
                    }
                )
                device = TorchDevicePool(engine.geometry(), cap * PAGE)
                t0 = time.perf_counter()
                with TieredCache.open(engine, device) as cache:
                    results[name] = _replay(cache, requests)
                    results[name]["failures"] = cache.stats()["failures"]
                results[name]["seconds"] = time.perf_counter() - t0
    finally:
        master.close()
    base = results["file alone"]["hit_ratio"]
    for name, result in results.items():
        line = {
            "bench": "tiers",
            "case": f"{name}: {len(requests)} requests, file tier "
            f"{args.file_fraction:.0%} of {distinct} blocks",
            "ours": round(result["hit_ratio"], 4),
            "baseline": round(base, 4),
            "baseline_name": "file tier alone",
            "unit": "prefix hit ratio",
            "ratio": round(result["hit_ratio"] / base, 3) if base else None,
            "target": None,
            "tiers": result["tiers"],
            "seconds": round(result["seconds"], 2),
            "failures": result["failures"],
        }
        print(json.dumps(line), flush=True)
        per_tier = "; ".join(
            f"{t['tier']}: {t['hits']} hits, {t['bytes_read'] / 1e6:.1f} MB read, "
            f"median {t['get_ms_per_page_median'] or 0:.3f} ms/page"
            for t in result["tiers"]
        )
        print(f"{name:<20} hit ratio {result['hit_ratio']:.3f}  ({per_tier})", file=sys.stderr)


if __name__ == "__main__":
    main()
