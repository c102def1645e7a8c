"""kvtier's vLLM connector vs recomputing the prefix vs vLLM's own ExampleConnector.

Usage: ``python benchmarks/vllm.py [--quick] [--workload shared|trace|miss|all] [--reps N]
[--requests N] [--trace-every K] [--backend NAME]``, with any python: the engines run with the vLLM
environment's python (``scripts/install-vllm.sh``: ``.venv-vllm`` or ``$KVTIER_VLLM_VENV``).
One JSON object per line on stdout, a table on stderr.

Model: a random-weight Llama built here (no download): 4 layers, hidden 512, 8 heads of
64, 4 KV heads, MLP 1024, bfloat16; ``--quick``: 2 layers, hidden 256. vLLM's CPU build,
``enforce_eager``, block size 32. Three engines, each in its own process (a vLLM process
holds one KV connector), started once per workload and driven in turn, round by round, so
all see the same machine conditions:

- ``kvtier``: ``KvtierConnector`` on the ``file`` backend (``--backend``: another, such as
  ``segment``, which packs a prefix's pages into one segment file) in a temporary directory, full
  verification (every page's checksum checked on load), pages persisted as files;
- ``recompute``: no connector, vLLM computes what its own prefix cache does not hold;
- ``example``: vLLM's ``ExampleConnector``, which stores each layer's KV as safetensors
  files per prompt (it matches the whole prompt minus its last partial block).

Workloads:

- ``shared``: every request is a shared prefix of 2048 tokens (1024 with ``--quick``) plus
  its own 16-token suffix, ``--requests`` (4) at once; vLLM's own prefix cache off (the case
  kvtier exists for: the prefix's KV is no longer in the engine's memory), the stores in a
  warm page cache. Cases: time to first token (``max_tokens=1``) and total time
  (``max_tokens=32``), kvtier against each other engine (the ratio is the other's time over
  kvtier's). Targets: TTFT at most 0.5 x recompute's (ratio 2.0) and below
  ExampleConnector's (ratio 1.0). Each round checks both connectors reported the prefix
  as not computed and counts the requests whose greedy tokens differ from recompute's
  (bfloat16 rounding of a prefix computed in another batch; ``tests/test_vllm.py`` checks
  exact equality).
- ``trace``: the Mooncake FAST'25 synthetic trace (``/work/shared/traces``, see its README)
  replayed in order, scaled to the tiny model: each 512-token block id becomes a fixed
  run of ``--block-tokens`` tokens (16; 32 without ``--quick``), so equal ids at equal
  positions are shared prefixes; every ``--trace-every``-th request (10; 2) of the trace,
  at most 32 blocks each, output lengths scaled the same way (at most 8 tokens), sent
  ``--requests`` at a time. vLLM's prefix cache on (its default) but held to 256 blocks of
  32 tokens, below the trace's working set, and the page cache of both connectors' files
  dropped before every round (``posix_fadvise(DONTNEED)`` after ``fdatasync``), so their
  hits are read from the disk. Reported per engine: throughput (prompt and generated
  tokens per second of the rounds' time), time to first token p50 and p99 (vLLM's
  per-request stats), and hit ratio (tokens vLLM did not compute over prompt tokens).
- ``miss``: a 0 %-hit workload, prompts of 512 tokens sharing nothing, 8 tokens each, 4 at
  once: kvtier stores every page and finds nothing; its time against no connector's, with
  a target ratio of 0.98 (kvtier costs at most 2 %).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

# This file is named vllm.py: drop its folder from the path so that `vllm` is vLLM.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
ROOT = _HERE.parent
VENV = Path(os.environ.get("KVTIER_VLLM_VENV", ROOT / ".venv-vllm"))
BLOCK = 32
SUFFIX = 16
ENGINES = ("kvtier", "recompute", "example")
MODELS = {
    "full": {"layers": 4, "hidden": 512, "heads": 8, "kv_heads": 4, "intermediate": 1024},
    "quick": {"layers": 2, "hidden": 256, "heads": 4, "kv_heads": 2, "intermediate": 512},
}


# --- the engine side (runs with the vLLM environment's python) ---------------------------


#: kvtier's storage backend in this run (``--backend``).
BACKEND = ["file"]


def _transfer_config(kind: str, store: Path, backend: str = "file") -> dict[str, Any] | None:
    if kind == "kvtier":
        return {
            "kv_connector": "KvtierConnector",
            "kv_connector_module_path": "kvtier.integrations.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "kvtier": {"backend": backend, "extra_config": {"root": str(store)}}
            },
        }
    if kind == "example":
        return {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(store)},
        }
    return None


def _clamp_example_hits(layers: int) -> None:
    """Two fixes to vLLM 0.32's ExampleConnector (a debugging connector), harness only.

    It answers ``stored prompt - vLLM's own hit``, negative when vLLM's prefix cache holds
    more (a resumed request's output tokens), and its stats logger then raises: the answer
    is clamped at 0 (no hit), and a request resumed after a preemption (whose files it
    would look for under its prompt and output tokens, which name no entry) gets none. It
    counts a prompt stored once its folder exists, before the layers' files are written,
    and it checks another folder than it loads for a prompt of whole blocks and one token,
    so a load fails on a missing file: a hit needs every layer's file in the folder the
    load reads, and a prompt of one block or less (keyed as the empty prompt) never hits.
    """
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1 import example_connector

    cls = example_connector.ExampleConnector
    matched = cls.get_num_new_matched_tokens
    found = cls._found_match_for_prompt

    def complete(self: Any, prompt_token_ids: list[int], mm_hashes: list[str]) -> bool:
        if not found(self, prompt_token_ids, mm_hashes):
            return False
        # the folder its load reads (and its store writes): the prompt's full blocks, which
        # for a prompt of k blocks and 1 token is not the folder it checked
        checked = example_connector.align_to_block_size(len(prompt_token_ids), self._block_size)
        if checked <= 0:  # a prompt of a block or less: it would "hit" the empty prompt
            return False
        folder = self._generate_foldername_debug(
            torch.tensor(prompt_token_ids)[:checked], mm_hashes, create_folder=False
        )
        return len(list(Path(folder).glob("*.safetensors"))) >= layers

    cls._found_match_for_prompt = complete

    def clamped(self: Any, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        if getattr(request, "num_preemptions", 0):
            return 0, False  # it would load a resumed request's files under another name
        tokens, load_async = matched(self, request, num_computed_tokens)
        if tokens is not None and tokens < 0:
            return 0, False
        return tokens, load_async

    cls.get_num_new_matched_tokens = clamped


def serve(kind: str, model: str, store: Path, options: dict[str, Any]) -> None:
    """Run one engine; answer each JSON line on stdin (a round) with one on stdout."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    out: IO[str] = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM prints to stdout too; keep our channel clean
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = {}
    transfer = _transfer_config(kind, store, str(options.get("backend", "file")))
    if transfer is not None:
        kwargs["kv_transfer_config"] = transfer
    if kind == "example":
        _clamp_example_hits(int(options["layers"]))
    if options.get("num_gpu_blocks"):
        kwargs["num_gpu_blocks_override"] = options["num_gpu_blocks"]
    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        enforce_eager=True,
        block_size=BLOCK,
        max_model_len=options["max_len"],
        enable_prefix_caching=bool(options.get("prefix_caching", False)),
        disable_log_stats=False,  # per-request stats: time to first token
        seed=0,
        **kwargs,
    )
    core = llm.llm_engine.engine_core.engine_core
    out.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        job = json.loads(line)
        counts = job["max_tokens"]
        if isinstance(counts, int):
            counts = [counts] * len(job["prompts"])
        params = [SamplingParams(temperature=0, max_tokens=n, detokenize=False) for n in counts]
        prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        first = time.perf_counter() - t0
        while core.scheduler.has_requests():  # finished requests whose stores still run
            core.step()
        seconds = time.perf_counter() - t0  # the round's cost, stores included
        connector = getattr(core.scheduler, "connector", None)
        answer = {
            "seconds": seconds,
            "generate_seconds": first,
            "tokens": [list(o.outputs[0].token_ids) for o in outputs],
            "cached": [int(o.num_cached_tokens or 0) for o in outputs],
            "ttft": [getattr(o.metrics, "first_token_latency", None) for o in outputs],
            "kvtier": getattr(connector, "kvtier_stats", dict)(),
        }
        out.write(json.dumps(answer) + "\n")
    os._exit(0)


# --- the driver (any python) ----------------------------------------------------------------


class _Engine:
    def __init__(
        self, kind: str, python: Path, model: Path, store: Path, options: dict[str, Any]
    ) -> None:
        self.kind = kind
        self.store = store
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [str(python), __file__, "--serve", kind, str(model), str(store), json.dumps(options)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            cwd=ROOT,
        )

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.log.seek(0)
            tail = self.log.read()[-3000:]
            raise SystemExit(f"the {self.kind} engine exited; its log ends with:\n{tail}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def ready(self) -> None:
        self._read()

    def round(self, prompts: list[list[int]], max_tokens: int | list[int]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def _start(
    kinds: tuple[str, ...], python: Path, model: Path, work: Path, options: dict[str, Any]
) -> list[_Engine]:
    spec = json.loads((model / "kvtier-tiny-model.json").read_text())
    options = {**options, "layers": spec["layers"], "backend": BACKEND[0]}
    engines = [_Engine(k, python, model, work / k, options) for k in kinds]
    for engine in engines:  # one at a time: start-up is CPU bound
        engine.ready()
    return engines


def _close(engines: list[_Engine]) -> None:
    for engine in engines:
        engine.close()


def drop_page_cache(root: Path) -> int:
    """Evict ``root``'s files from the page cache (written back first); the count of files.

    ``posix_fadvise(DONTNEED)`` drops a file's clean pages without privileges, so the
    next read of a stored page comes from the disk, as with a working set above memory.
    """
    count = 0
    for path in root.rglob("*"):
        if not path.is_file():
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            count += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return count


def _python() -> Path:
    python = VENV / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"no vLLM environment at {VENV}: run scripts/install-vllm.sh first")
    return python


def _line(
    case: str,
    ours: float,
    base: float,
    name: str,
    target: float | None,
    *,
    unit: str = "s",
    higher_is_better: bool = False,
) -> None:
    ratio = (ours / base if base else float("inf")) if higher_is_better else base / ours
    row = {
        "bench": "vllm",
        "case": case,
        "ours": round(ours, 4),
        "baseline": round(base, 4),
        "baseline_name": name,
        "unit": unit,
        "ratio": round(ratio, 3),
        "target": target,
        "backend": BACKEND[0],
    }
    print(json.dumps(row), flush=True)
    print(
        f"{case:<46} kvtier {ours:9.4f} {unit:<9} {name:<16} {base:9.4f}  ratio {ratio:6.2f}"
        f"  target {target}",
        file=sys.stderr,
    )


def _model(python: Path, work: Path, size: str) -> Path:
    model = work / "model"
    spec = MODELS[size]
    subprocess.run(
        [str(python), str(ROOT / "tests" / "vllm_engine" / "tiny_model.py"), str(model)]
        + [f"--{k.replace('_', '-')}={v}" for k, v in spec.items()],
        check=True,
        capture_output=True,
    )
    return model


# --- workload: one shared prefix, warm page cache ---------------------------------------------


def run_shared(args: argparse.Namespace, python: Path, model: Path, work: Path) -> None:
    """The shared-prefix workload (see the module docstring)."""
    prefix_len = 1024 if args.quick else 2048
    reps = args.reps or (3 if args.quick else 7)
    print(
        f"shared: prefix {prefix_len} tokens + {SUFFIX}, {args.requests} requests per round, "
        f"{reps} rounds",
        file=sys.stderr,
    )
    options = {"max_len": prefix_len + SUFFIX + 64, "prefix_caching": False}
    engines = _start(ENGINES, python, model, work / "shared", options)
    try:
        rng = random.Random(0)
        prefix = [rng.randrange(1, 500) for _ in range(prefix_len)]

        def prompts() -> list[list[int]]:
            return [
                prefix + [rng.randrange(1, 500) for _ in range(SUFFIX)]
                for _ in range(args.requests)
            ]

        warm = prompts()
        for engine in engines:
            engine.round(warm[:1], 1)  # stores the prefix (kvtier and example)
            engine.round(warm, 1)  # first hits: the loaders' warm-up
        samples: dict[tuple[str, int], list[float]] = {}
        differ = {"kvtier": 0, "example": 0}
        requests = 0
        for _ in range(reps):
            for max_tokens in (1, 32):
                batch = prompts()
                answers = {e.kind: e.round(batch, max_tokens) for e in engines}
                for kind in ("kvtier", "example"):
                    differ[kind] += sum(
                        x != y
                        for x, y in zip(
                            answers[kind]["tokens"], answers["recompute"]["tokens"], strict=True
                        )
                    )
                requests += args.requests
                for kind in ("kvtier", "example"):
                    if answers[kind]["cached"] != [prefix_len] * args.requests:
                        raise SystemExit(
                            f"{kind} did not load the prefix: cached {answers[kind]['cached']}"
                        )
                for kind, answer in answers.items():
                    samples.setdefault((kind, max_tokens), []).append(answer["generate_seconds"])
    finally:
        _close(engines)
    med = {key: statistics.median(v) for key, v in samples.items()}
    for (kind, max_tokens), values in sorted(samples.items()):
        shown = " ".join(f"{x:.3f}" for x in values)
        print(f"samples {kind:<10} max_tokens={max_tokens:<3} {shown}", file=sys.stderr)
    print(
        f"greedy tokens that differ from recompute's: kvtier {differ['kvtier']}, "
        f"ExampleConnector {differ['example']} of {requests} requests (a loaded prefix's KV "
        "was computed in another batch than recompute's, so bfloat16 rounding differs; "
        "tests/test_vllm.py checks exact equality request by request)",
        file=sys.stderr,
    )
    label_n = f"{args.requests} request{'s' if args.requests > 1 else ''}"
    for max_tokens, label in ((1, "time to first token"), (32, "total, 32 tokens")):
        ours = med[("kvtier", max_tokens)]
        target_re = 2.0 if max_tokens == 1 else None
        target_ex = 1.0 if max_tokens == 1 else None
        case = f"shared prefix, {label_n}: {label}"
        _line(case, ours, med[("recompute", max_tokens)], "recompute", target_re)
        _line(case, ours, med[("example", max_tokens)], "ExampleConnector", target_ex)


# --- workload: the Mooncake trace, page cache dropped ----------------------------------------

TRACE = Path(
    os.environ.get("KVTIER_TRACE", "/work/shared/traces/mooncake_fast25_synthetic_trace.jsonl")
)
TRACE_BLOCK = 512
MAX_BLOCKS = 32
MAX_OUTPUT = 8
#: vLLM's own KV space in the trace replay, in blocks: below the trace's working set.
TRACE_KV_BLOCKS = 256


def trace_requests(
    path: Path, every: int, block_tokens: int, limit: int | None = None
) -> list[tuple[list[int], int]]:
    """Every ``every``-th request of the trace as (prompt tokens, output tokens), scaled.

    Each 512-token block id becomes the same ``block_tokens`` tokens wherever it appears
    (a shared id is a shared prefix); a prompt is its ids' runs, cut to its scaled input
    length (its last block may be partial), at most :data:`MAX_BLOCKS` blocks.
    """
    runs: dict[int, list[int]] = {}

    def run(block: int) -> list[int]:
        tokens = runs.get(block)
        if tokens is None:
            rng = random.Random(block * 2654435761 % (1 << 32))
            tokens = runs[block] = [rng.randrange(1, 500) for _ in range(block_tokens)]
        return tokens

    requests: list[tuple[list[int], int]] = []
    with open(path) as handle:
        for i, line in enumerate(handle):
            if i % every:
                continue
            record = json.loads(line)
            ids = record["hash_ids"][:MAX_BLOCKS]
            if not ids:
                continue
            length = -(-int(record["input_length"]) * block_tokens // TRACE_BLOCK)
            prompt = [t for block in ids for t in run(block)][: max(1, length)]
            scaled = round(int(record["output_length"]) * block_tokens / TRACE_BLOCK)
            requests.append((prompt, max(1, min(MAX_OUTPUT, scaled))))
            if limit is not None and len(requests) >= limit:
                break
    return requests


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    at = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[at]


def run_trace(args: argparse.Namespace, python: Path, model: Path, work: Path) -> None:
    """The trace replay (see the module docstring)."""
    every = args.trace_every or (10 if args.quick else 2)
    block_tokens = args.block_tokens or (16 if args.quick else 32)
    requests = trace_requests(TRACE, every, block_tokens)
    rounds = [requests[i : i + args.requests] for i in range(0, len(requests), args.requests)]
    print(
        f"trace: {len(requests)} requests (every {every}th of {TRACE.name}), block id -> "
        f"{block_tokens} tokens, at most {MAX_BLOCKS} blocks, {args.requests} per round; "
        f"vLLM's KV space {TRACE_KV_BLOCKS} blocks, page cache dropped before every round",
        file=sys.stderr,
    )
    options = {
        "max_len": MAX_BLOCKS * block_tokens + MAX_OUTPUT + 64,
        "prefix_caching": True,
        "num_gpu_blocks": TRACE_KV_BLOCKS,
    }
    engines = _start(ENGINES, python, model, work / "trace", options)
    totals = {e.kind: {"seconds": 0.0, "tokens": 0, "cached": 0, "prompt": 0} for e in engines}
    ttft: dict[str, list[float]] = {e.kind: [] for e in engines}
    dropped = 0
    try:
        for batch in rounds:
            prompts = [prompt for prompt, _ in batch]
            counts = [count for _, count in batch]
            for engine in engines:
                if engine.store.exists():
                    dropped += drop_page_cache(engine.store)
                answer = engine.round(prompts, counts)
                total = totals[engine.kind]
                total["seconds"] += answer["seconds"]
                total["tokens"] += sum(map(len, prompts)) + sum(map(len, answer["tokens"]))
                total["cached"] += sum(answer["cached"])
                total["prompt"] += sum(map(len, prompts))
                ttft[engine.kind] += [t for t in answer["ttft"] if t is not None]
    finally:
        _close(engines)
    summary = {}
    for kind, total in totals.items():
        summary[kind] = {
            "throughput": total["tokens"] / total["seconds"],
            "p50": _percentile(ttft[kind], 0.5),
            "p99": _percentile(ttft[kind], 0.99),
            "hit": total["cached"] / max(1, total["prompt"]),
        }
        row = summary[kind]
        print(
            f"trace {kind:<10} {row['throughput']:9.1f} tokens/s  TTFT p50 {row['p50']:.4f} s "
            f"p99 {row['p99']:.4f} s  hit ratio {row['hit']:.3f}  ({total['seconds']:.1f} s)",
            file=sys.stderr,
        )
    print(f"trace: page-cache drops of {dropped} files", file=sys.stderr)
    ours = summary["kvtier"]
    for name, label in (("recompute", "recompute"), ("example", "ExampleConnector")):
        base = summary[name]
        _line(
            "trace, cold page cache: throughput",
            ours["throughput"],
            base["throughput"],
            label,
            1.0 if name == "recompute" else None,
            unit="tokens/s",
            higher_is_better=True,
        )
        _line("trace, cold page cache: TTFT p50", ours["p50"], base["p50"], label, None)
        _line("trace, cold page cache: TTFT p99", ours["p99"], base["p99"], label, None)
        _line(
            "trace, cold page cache: hit ratio",
            ours["hit"],
            base["hit"],
            label,
            None,
            unit="ratio",
            higher_is_better=True,
        )


# --- workload: 0 % hits -------------------------------------------------------------------------


def run_miss(args: argparse.Namespace, python: Path, model: Path, work: Path) -> None:
    """The 0 %-hit workload (see the module docstring)."""
    reps = args.reps or (5 if args.quick else 15)
    length, count = 512, 8
    print(
        f"miss: {args.requests} prompts of {length} tokens sharing nothing, {count} tokens "
        f"each, {reps} rounds",
        file=sys.stderr,
    )
    options = {"max_len": length + count + 64, "prefix_caching": True}
    engines = _start(("kvtier", "recompute"), python, model, work / "miss", options)
    rng = random.Random(1)
    samples: dict[str, list[float]] = {"kvtier": [], "recompute": []}
    served: dict[str, list[float]] = {"kvtier": [], "recompute": []}
    stored = 0
    try:
        for rep in range(reps + 1):  # the first round warms up
            batch = [[rng.randrange(1, 500) for _ in range(length)] for _ in range(args.requests)]
            for engine in engines if rep % 2 else reversed(engines):
                answer = engine.round(batch, count)
                if answer["cached"] != [0] * len(batch):
                    raise SystemExit(f"{engine.kind} found a hit in a 0 % workload")
                if rep:
                    samples[engine.kind].append(answer["seconds"])
                    served[engine.kind].append(answer["generate_seconds"])
                if engine.kind == "kvtier":
                    stored = answer["kvtier"].get("save_pages_planned", 0)
    finally:
        _close(engines)
    for kind, values in samples.items():
        shown = " ".join(f"{x:.3f}" for x in values)
        print(f"samples miss {kind:<10} {shown}", file=sys.stderr)
    print(f"miss: kvtier planned {stored} page stores and found no hit", file=sys.stderr)
    _line(
        "0 % hits: time to serve (stores may still run)",
        statistics.median(served["kvtier"]),
        statistics.median(served["recompute"]),
        "no connector",
        None,
    )
    _line(
        "0 % hits: round time, stores included",
        statistics.median(samples["kvtier"]),
        statistics.median(samples["recompute"]),
        "no connector",
        0.98,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workload", choices=("shared", "trace", "miss", "all"), default="all")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--trace-every", type=int, default=None)
    parser.add_argument("--block-tokens", type=int, default=None)
    parser.add_argument(
        "--backend",
        default="file",
        help="kvtier's storage backend (file, segment, uring, ...; default file)",
    )
    parser.add_argument("--serve", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    BACKEND[0] = args.backend
    if args.serve:
        kind, model, store, options = args.serve
        serve(kind, model, Path(store), json.loads(options))
        return
    python = _python()
    size = "quick" if args.quick else "full"
    work = Path(tempfile.mkdtemp(prefix="kvtier-bench-vllm-"))
    try:
        model = _model(python, work, size)
        print(f"model: Llama {MODELS[size]}, bfloat16", file=sys.stderr)
        workloads = ("shared", "trace", "miss") if args.workload == "all" else (args.workload,)
        for workload in workloads:
            {"shared": run_shared, "trace": run_trace, "miss": run_miss}[workload](
                args, python, model, work
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
