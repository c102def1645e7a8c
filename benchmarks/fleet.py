"""Two vLLM engines behind a router: round-robin against kvtier's event router, and one
engine alone, on a slice of the Mooncake FAST'25 synthetic trace.

Usage: ``python benchmarks/fleet.py [--quick] [--requests N] [--start I] [--speed S]
[--tiers local|shared] [--model small|tiny] [--reps N] [--work-weight W]``, with any
python (the engines run with the vLLM environment's, ``scripts/install-vllm.sh``:
``.venv-vllm`` or ``$KVTIER_VLLM_VENV``).
One JSON object per replay on stdout, then one per deployment with the medians over its
``--reps`` replays (run in rotating order, interleaved), then the router's ratios against
round-robin; a table of the medians on stderr. The run fails (exit 1) if a request failed.

The fleet: two real vLLM CPU engines (``tests/vllm_engine/server.py``, a random-weight
Llama built here: ``--model small``, 4 layers, hidden 512, 8 heads, 4 KV heads, pages of
128 KiB; ``tiny`` with ``--quick``, 2 layers, hidden 256; block size 32; each engine
bound to its own core), each with vLLM's
prefix cache held to ``--gpu-blocks`` blocks and kvtier's connector over a chain of
tiers: a ``file`` tier of its own (``--file-capacity``), and with ``--tiers shared`` (the
default) one Mooncake store below both, on one master on loopback. Both engines publish
their KV events (vLLM's ZMQ publisher: their own blocks and kvtier's tiers', medium
``KVTIER:<tier>``); the router (:mod:`kvtier.integrations.router`) subscribes to both.

The workload: ``--requests`` consecutive requests of the trace from ``--start`` (a late
stretch, where the trace reuses most), each 512-token block id mapped to a fixed run of
32 tokens (at most ``--max-blocks`` blocks; the request's last block is cut to its scaled
length), ``--max-tokens`` generated, sent open-loop at the trace's arrival times divided by
``--speed``. Each deployment replays the same slice with its own token map (no deployment
can hit another's pages), in one run on the same two engines:

- ``one engine``: every request to engine a;
- ``round-robin``: alternately to a and b;
- ``event router``: to the engine whose tiers hold the longest prefix, by load among equals;
- with ``--work-weight W``, also ``work router``: the same events, the engine with the
  least prefill work (this request's uncached tokens plus W times those queued there).

Reported per deployment: prefix hit ratio (prompt tokens vLLM did not compute, its own
cache and kvtier's tiers, over prompt tokens), time to first token p50 and p99 (from the
moment the engine read the request), throughput (prompt and generated tokens over the
replay's makespan), requests per engine, and kvtier's load failures (pages missing at
the read, such as evicted from a full tier since the lookup, or refused by their check:
recomputed, never served) with the refused ones apart (``invalid_pages``); and the
slice's ceiling, the hit ratio of one cache that never forgets (no placement beats it).
Targets: the router's hit ratio at least 1.5 x round-robin's, its p50 time to first
token lower.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

# benchmarks/vllm.py sits beside this file: drop its folder from the path so that `vllm` is vLLM.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
ROOT = _HERE.parent
VENV = Path(os.environ.get("KVTIER_VLLM_VENV", ROOT / ".venv-vllm"))
TRACE = Path(os.environ.get("KVTIER_TRACE", ROOT.parent / "shared" / "traces"))
TRACE_FILE = "mooncake_fast25_synthetic_trace.jsonl"
BLOCK = 32
MODELS = {
    "small": {"layers": 4, "hidden": 512, "heads": 8, "kv_heads": 4, "intermediate": 1024},
    "tiny": {"layers": 2, "hidden": 256, "heads": 4, "kv_heads": 2, "intermediate": 512},
}
DEPLOYMENTS = ("one engine", "round-robin", "event router")
TARGET_HIT = 1.5


def _model(python: Path, work: Path, size: str) -> Path:
    model = work / "model"
    subprocess.run(
        [str(python), str(ROOT / "tests" / "vllm_engine" / "tiny_model.py"), str(model)]
        + [f"--{k.replace('_', '-')}={v}" for k, v in MODELS[size].items()],
        check=True,
        capture_output=True,
    )
    return model


def load_slice(start: int, count: int, max_blocks: int) -> list[dict[str, Any]]:
    """``count`` trace rows from ``start``: arrival (s), block ids, prompt and output length."""
    rows = []
    with open(TRACE / TRACE_FILE) as handle:
        for i, line in enumerate(handle):
            if i < start:
                continue
            if len(rows) >= count:
                break
            row = json.loads(line)
            ids = row["hash_ids"][:max_blocks]
            # the last block holds the rest of the prompt, scaled 512 -> 32 tokens
            scaled = max(1, row["input_length"] * BLOCK // 512)
            length = min(len(ids) * BLOCK, max(scaled, (len(ids) - 1) * BLOCK + 1))
            rows.append(
                {
                    "at": row["timestamp"] / 1000.0,
                    "ids": ids,
                    "length": length,
                    "output": row["output_length"],
                }
            )
    first = rows[0]["at"]
    for row in rows:
        row["at"] -= first
    return rows


def prompts_of(rows: list[dict[str, Any]], seed: int) -> list[list[int]]:
    """Each row's prompt: its block ids as fixed token runs (``seed`` picks the runs)."""
    runs: dict[int, list[int]] = {}
    out = []
    for row in rows:
        tokens: list[int] = []
        for block in row["ids"]:
            if block not in runs:
                rng = random.Random(seed * 1_000_003 + block)
                runs[block] = [rng.randrange(1, 500) for _ in range(BLOCK)]
            tokens += runs[block]
        out.append(tokens[: row["length"]])
    return out


def ceiling(rows: list[dict[str, Any]]) -> float:
    """The slice's hit ratio with one cache that never forgets (the most any placement of
    its requests can reach): each request's longest prefix of block ids seen before, in
    whole blocks, its last token always computed, over prompt tokens."""
    seen: set[tuple[int, ...]] = set()
    hit = total = 0
    for row in rows:
        ids = row["ids"]
        found = 0
        while found < len(ids) and tuple(ids[: found + 1]) in seen:
            found += 1
        hit += min(found, (row["length"] - 1) // BLOCK) * BLOCK
        total += row["length"]
        seen.update(tuple(ids[: i + 1]) for i in range(len(ids)))
    return hit / total if total else 0.0


def _section(name: str, work: Path, args: argparse.Namespace, master: str | None) -> dict[str, Any]:
    tiers: list[dict[str, Any]] = [
        {
            "backend": "file",
            "extra_config": {
                "root": str(work / f"pages-{name}"),
                "capacity_bytes": args.file_capacity,
            },
        }
    ]
    if master is not None:
        tiers.append(
            {
                "backend": "mooncake",
                "extra_config": {"master_address": master, "global_segment_size": 0},
            }
        )
    return {"tiers": tiers}


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def replay(
    deployment: str,
    engines: dict[str, Any],
    router: Any,
    rows: list[dict[str, Any]],
    prompts: list[list[int]],
    args: argparse.Namespace,
    tag: str,
) -> dict[str, Any]:
    """Send the slice open-loop through ``deployment``; the per-request results."""
    names = list(engines)
    results: list[dict[str, Any] | None] = [None] * len(rows)
    placed: list[str] = [""] * len(rows)
    errors: list[str] = []
    lock = threading.Lock()

    def wait(i: int, engine: str) -> None:
        try:
            done = engines[engine].result(f"{tag}-{i}", timeout=600)
        except Exception as exc:
            with lock:
                errors.append(f"{tag}-{i}: {exc}")
            done = None
        if router is not None:
            router.finished(engine, f"{tag}-{i}")
        results[i] = done

    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=len(rows)) as pool:
        for i, (row, prompt) in enumerate(zip(rows, prompts, strict=True)):
            delay = t0 + row["at"] / args.speed - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            if deployment == "one engine":
                engine = names[0]
            elif deployment == "round-robin":
                engine = names[i % len(names)]
            else:
                engine = router.route(prompt, request_id=f"{tag}-{i}").engine
            placed[i] = engine
            engines[engine].submit(f"{tag}-{i}", prompt, min(row["output"], args.max_tokens))
            pool.submit(wait, i, engine)
    makespan = time.monotonic() - t0
    done = [r for r in results if r is not None]
    prompt_tokens = sum(len(prompts[i]) for i, r in enumerate(results) if r is not None)
    cached = sum(int(r["cached"]) for r in done)
    generated = sum(len(r["tokens"]) for r in done)
    ttft = [float(r["ttft_s"]) for r in done]
    return {
        "bench": "fleet",
        "deployment": deployment,
        "requests": len(rows),
        "completed": len(done),
        "errors": errors[:5],
        "hit_ratio": round(cached / prompt_tokens, 4) if prompt_tokens else 0.0,
        "ttft_p50_s": round(statistics.median(ttft), 4) if ttft else None,
        "ttft_p99_s": round(_percentile(ttft, 0.99), 4) if ttft else None,
        "throughput_tok_s": round((prompt_tokens + generated) / makespan, 1),
        "makespan_s": round(makespan, 2),
        "per_engine": {name: placed.count(name) for name in names},
    }


def _medians(runs: list[dict[str, Any]], deployments: list[str]) -> list[dict[str, Any]]:
    """Per deployment, the median of each figure over its reps (one row each)."""
    rows = []
    for deployment in deployments:
        mine = [r for r in runs if r["deployment"] == deployment]
        row = {**mine[0], "rep": "median", "reps": len(mine)}
        for key in ("hit_ratio", "ttft_p50_s", "ttft_p99_s", "throughput_tok_s", "makespan_s"):
            row[key] = round(statistics.median(r[key] for r in mine), 4)
        row["completed"] = sum(r["completed"] for r in mine)
        row["requests"] = sum(r["requests"] for r in mine)
        row["load_failed_pages"] = sum(r["load_failed_pages"] for r in mine)
        row["invalid_pages"] = sum(r["invalid_pages"] for r in mine)
        row["errors"] = [e for r in mine for e in r["errors"]][:5]
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def _failures(engines: dict[str, Any]) -> tuple[int, int]:
    """Pages whose load failed (missing at the read, such as evicted since the lookup, or
    invalid), and of those the ones a check refused (invalid: corrupt, torn, foreign)."""
    failed = invalid = 0
    for engine in engines.values():
        worker = engine.stats().get("worker") or {}
        failed += int(worker.get("load_failed_pages", 0))
        invalid += sum(int(v) for k, v in worker.items() if k.startswith("store_invalid_"))
    return failed, invalid


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Start the fleet, replay each deployment, print and return their rows."""
    sys.path.insert(0, str(ROOT / "tests" / "vllm_engine"))
    from served import ServedEngine

    from kvtier.integrations.router import EventFeed, PrefixRouter

    python = VENV / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"no vLLM environment at {VENV}: run scripts/install-vllm.sh")
    work = Path(tempfile.mkdtemp(prefix="kvtier-fleet-"))
    model = _model(python, work, args.model)
    rows = load_slice(args.start, args.requests, args.max_blocks)
    master = None
    address = None
    if args.tiers == "shared":
        from kvtier.testing.mooncake import MooncakeMaster

        os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        master = MooncakeMaster(storage_node_bytes=512 << 20).start()
        address = master.address
    deployments = list(DEPLOYMENTS) + (["work router"] if args.work_weight > 0 else [])
    engines: dict[str, Any] = {}
    feeds: list[Any] = []
    runs: list[dict[str, Any]] = []
    out: list[dict[str, Any]] = []
    try:
        for core, name in enumerate(("a", "b")):
            job = {
                "model": str(model),
                "connector": "kvtier",
                "kvtier": _section(name, work, args, address),
                "num_gpu_blocks": args.gpu_blocks,
                "max_model_len": args.max_blocks * BLOCK + 64,
                "kv_events_endpoint": f"ipc://{work}/events-{name}",
            }
            env = {"VLLM_CPU_OMP_THREADS_BIND": str(core % (os.cpu_count() or 1))}
            engines[name] = ServedEngine(python, job, work, env=env, name=name)
        block = 0
        for engine in engines.values():
            block = int(engine.wait_ready()["block_size"])
        router = PrefixRouter(list(engines), block_size=block, balance_slack=args.slack)
        routers = {
            "event router": router,
            "work router": PrefixRouter(
                list(engines),
                block_size=block,
                balance_slack=args.slack,
                work_weight=args.work_weight or 1.0,
                index=router.index,
            ),
        }
        feeds = [EventFeed(f"ipc://{work}/events-{n}", n, router) for n in engines]
        seed = 0
        for rep in range(args.reps):
            # each rep in another order, so no deployment always runs on the warmest machine
            turn = rep % len(deployments)
            for deployment in deployments[turn:] + deployments[:turn]:
                seed += 1
                failed = _failures(engines)
                chosen = {"a": engines["a"]} if deployment == "one engine" else engines
                prompts = prompts_of(rows, seed)
                chooser = routers.get(deployment)
                row = replay(deployment, chosen, chooser, rows, prompts, args, f"d{seed}")
                now = _failures(engines)
                row["load_failed_pages"] = now[0] - failed[0]
                row["invalid_pages"] = now[1] - failed[1]
                row["tiers"] = args.tiers
                row["rep"] = rep
                runs.append(row)
                print(json.dumps(row), flush=True)
        out.extend(_medians(runs, deployments))
        row = {"bench": "fleet", "router_events": dict(router.index.counters)}
        print(json.dumps(row), flush=True)
    finally:
        for feed in feeds:
            feed.close()
        for engine in engines.values():
            try:
                engine.quit()
            except Exception:
                engine.kill()
        if master is not None:
            master.close()
    by = {row["deployment"]: row for row in out}
    rr, ev = by["round-robin"], by["event router"]
    hit = ev["hit_ratio"] / rr["hit_ratio"] if rr["hit_ratio"] else float("inf")
    ttft = rr["ttft_p50_s"] / ev["ttft_p50_s"] if ev["ttft_p50_s"] else float("inf")
    best = ceiling(rows)
    ratios = {
        "bench": "fleet",
        "case": "event router vs round-robin",
        "hit_ratio_ratio": round(hit, 3),
        "hit_target": TARGET_HIT,
        "ceiling_hit_ratio": round(best, 4),
        "ceiling_vs_round_robin": round(best / rr["hit_ratio"], 3) if rr["hit_ratio"] else None,
        "ttft_p50_ratio": round(ttft, 3),
        "ttft_target": 1.0,
    }
    print(json.dumps(ratios), flush=True)
    print(
        f"{'deployment':<14} {'hit':>7} {'ttft p50':>9} {'ttft p99':>9} {'tok/s':>8}  engines",
        file=sys.stderr,
    )
    for row in out:
        print(
            f"{row['deployment']:<14} {row['hit_ratio']:7.3f} {row['ttft_p50_s']:9.4f}"
            f" {row['ttft_p99_s']:9.4f} {row['throughput_tok_s']:8.1f}  {row['per_engine']}",
            file=sys.stderr,
        )
    print(
        f"router / round-robin: hit ratio x{hit:.2f} (target {TARGET_HIT}), "
        f"p50 TTFT x{ttft:.2f} faster (target > 1); the slice's ceiling (one cache that "
        f"never forgets): hit ratio {best:.3f}",
        file=sys.stderr,
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="60 requests, the tiny model, one replay each"
    )
    parser.add_argument("--requests", type=int, default=None, help="trace rows (200)")
    parser.add_argument("--start", type=int, default=3700, help="first trace row (3700)")
    parser.add_argument("--speed", type=float, default=2.0, help="arrival time divisor (2)")
    parser.add_argument("--max-blocks", type=int, default=16, help="blocks per request (16)")
    parser.add_argument("--max-tokens", type=int, default=4, help="tokens generated, at most")
    parser.add_argument("--gpu-blocks", type=int, default=192, help="vLLM's blocks per engine")
    parser.add_argument("--file-capacity", default="64MiB", help="each engine's file tier")
    parser.add_argument("--tiers", choices=("local", "shared"), default="shared")
    parser.add_argument("--model", choices=tuple(MODELS), default=None, help="(small)")
    parser.add_argument("--slack", type=int, default=4, help="the router's balance slack (4)")
    parser.add_argument("--reps", type=int, default=3, help="replays of each deployment (3)")
    parser.add_argument(
        "--work-weight",
        type=float,
        default=0.0,
        help="also replay a router weighing prefill work with this weight (off: 0)",
    )
    args = parser.parse_args()
    if args.requests is None:
        args.requests = 60 if args.quick else 200
    if args.quick:
        args.reps = 1
    if args.model is None:
        args.model = "tiny" if args.quick else "small"
    rows = run(args)
    if any(row["completed"] < row["requests"] or row["errors"] for row in rows):
        raise SystemExit("fleet: some requests failed (see the rows' errors)")


if __name__ == "__main__":
    main()
