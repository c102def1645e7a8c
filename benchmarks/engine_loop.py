"""How much of a step's KV loading the vLLM device worker hides under the model's compute.

An engine-like loop (``kvtier.testing.engine_loop``): L layers of real matmuls on the
device and a paged KV cache in vLLM's accelerator layout, driven through the connector
hooks in vLLM's order (``start_load_kv``, per layer ``wait_for_layer_load`` / compute /
``save_kv_layer``, ``wait_for_save``, ``get_finished``). A prefix of P pages is stored
once; then each round times one step of each mode, the order rotating: ``none`` (no
loads), ``sync`` (all P pages loaded before the forward) and ``overlap`` (the worker's
default: each layer loaded at its own ``wait_for_layer_load``). After every loading step
the loaded blocks are compared byte for byte with what was saved (``wrong_bytes``, must
be 0).

``hidden_fraction = 1 - (t_overlap - t_none) / (t_sync - t_none)``: 1 when loading costs
the step nothing, 0 when it costs as much as loading first. Pick ``--hidden`` /
``--tokens`` so one layer computes at least as long as one layer of P pages loads (both
are printed: ``layer_compute_ms`` and ``layer_load_ms``). On the CPU compute and copies
share the same cores, so nothing can hide there: expect about 0.

    python benchmarks/engine_loop.py [--quick] [--device cuda|cpu] [--layers N]
        [--hidden N] [--tokens N] [--matmuls N] [--load-pages N] [--reps N] [--io-backend X]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys

os.environ.setdefault("KVTIER_DISABLE_PLUGIN_AUTOLOAD", "1")  # built-ins only, measured
if importlib.util.find_spec("kvtier") is None:  # run from a checkout, not installed
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from _device import emit, pick_device

from kvtier.testing.engine_loop import EngineLoop, LoopShape, Mode

#: One H200-sized default: an 8B-class KV geometry, 32 layers, 256 pages (16 MiB per
#: layer) loaded per step, and about a millisecond of bf16 matmuls per layer.
CUDA_SHAPE = LoopShape(
    layers=32,
    kv_heads=8,
    head_dim=128,
    block_size=16,
    num_blocks=512,
    load_pages=256,
    hidden=8192,
    tokens=2048,
    matmuls=2,
    compute_dtype=torch.bfloat16,
)
CPU_SHAPE = LoopShape(
    layers=8, kv_heads=4, head_dim=64, num_blocks=64, load_pages=16, hidden=512, tokens=128
)
QUICK_SHAPE = LoopShape()  # 4 small layers, 8 pages


def shape_from(args: argparse.Namespace, device: torch.device) -> LoopShape:
    """The default shape for the device (or ``--quick``), with the flags given applied."""
    base = QUICK_SHAPE if args.quick else (CUDA_SHAPE if device.type == "cuda" else CPU_SHAPE)
    fields = {
        "layers": args.layers,
        "hidden": args.hidden,
        "tokens": args.tokens,
        "matmuls": args.matmuls,
        "load_pages": args.load_pages,
    }
    given = {k: v for k, v in fields.items() if v is not None}
    if "load_pages" in given:
        given["num_blocks"] = max(base.num_blocks, 2 * given["load_pages"])
    values = {**base.__dict__, **given}
    return LoopShape(**values)


def main(argv: list[str] | None = None) -> int:
    """Time the three modes, check the loaded bytes, print the JSON lines; 1 on bad bytes."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 small layers, 8 pages, 5 reps")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if any)")
    parser.add_argument("--layers", type=int, default=None, help="layers of the model")
    parser.add_argument("--hidden", type=int, default=None, help="hidden size of the matmuls")
    parser.add_argument("--tokens", type=int, default=None, help="tokens (rows) per step")
    parser.add_argument("--matmuls", type=int, default=None, help="matmuls per layer")
    parser.add_argument("--load-pages", type=int, default=None, help="pages loaded per step")
    parser.add_argument("--reps", type=int, default=None, help="rounds (default 15, quick 5)")
    parser.add_argument("--io-backend", default="auto", help="kvtier IO backend (default auto)")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: 1 on cpu)"
    )
    args = parser.parse_args(argv)
    device = pick_device(args.device)
    shape = shape_from(args, device)
    reps = args.reps or (5 if args.quick else 15)
    threads = args.threads or (1 if device.type == "cpu" else None)
    if threads:  # on a small shared CPU, two-thread matmuls stall on other jobs
        torch.set_num_threads(threads)

    loop = EngineLoop(shape, device, section={"io_backend": args.io_backend})
    try:
        io_name = loop.worker.plan.io_backend.name
        layout = loop.worker.plan.layout.value
        loop.save_prefix()
        wrong: dict[str, int] = {"sync": 0, "overlap": 0}
        checked = {"sync": 0, "overlap": 0}

        def check(mode: Mode, count: int) -> None:
            wrong[mode] += count
            checked[mode] += 1

        times = loop.run_modes(reps, warmup=1, check=check).seconds
        load_errors = sorted(loop.load_errors())
        stats = loop.worker.stats()
    finally:
        loop.close()

    med = {mode: statistics.median(values) for mode, values in times.items()}
    paired = [
        1 - (o - n) / (s - n)
        for n, s, o in zip(times["none"], times["sync"], times["overlap"], strict=True)
        if s != n
    ]
    hidden = statistics.median(paired) if paired else None
    load_cost = med["sync"] - med["none"]
    of_medians = 1 - (med["overlap"] - med["none"]) / load_cost if load_cost else None
    page_bytes = shape.layers * 2 * shape.kv_heads * shape.head_dim * shape.block_size * 2
    label = (
        f"L{shape.layers} hidden {shape.hidden}x{shape.tokens}x{shape.matmuls} "
        f"P{shape.load_pages} {io_name}/{layout}"
    )
    common = {"device": str(device), "io": io_name, "layout": layout}
    print(f"engine_loop: {label} on {device}, {reps} rounds", file=sys.stderr)
    for mode in ("sync", "overlap"):
        ratio = med["sync"] / med[mode] if mode == "overlap" else 1.0
        emit(
            {
                "bench": "engine_loop",
                "case": f"step {mode} {label}",
                "ours": round(med[mode] * 1e3, 3),
                "baseline": round(med["none"] * 1e3, 3),
                "baseline_name": "step without loads",
                "unit": "ms",
                "ratio": round(med["none"] / med[mode], 3),
                "target": None,
                "vs_sync": round(ratio, 3),
                "wrong_bytes": wrong[mode],
                "checked_steps": checked[mode],
                **common,
            },
            f"step {mode:8s} {med[mode] * 1e3:9.3f} ms  (no loads {med['none'] * 1e3:.3f} ms)",
        )
    total_wrong = wrong["sync"] + wrong["overlap"]
    summary = {
        "bench": "engine_loop",
        "case": "summary",
        "hidden_fraction": None if hidden is None else round(hidden, 3),
        "hidden_fraction_of_medians": None if of_medians is None else round(of_medians, 3),
        "t_none_ms": round(med["none"] * 1e3, 3),
        "t_sync_ms": round(med["sync"] * 1e3, 3),
        "t_overlap_ms": round(med["overlap"] * 1e3, 3),
        "layer_compute_ms": round(med["none"] / shape.layers * 1e3, 4),
        "layer_load_ms": round(load_cost / shape.layers * 1e3, 4),
        "load_gbs": (
            round(shape.load_pages * page_bytes / load_cost / 1e9, 3) if load_cost > 0 else None
        ),
        "bytes_loaded_per_step": shape.load_pages * page_bytes,
        "wrong_bytes": total_wrong,
        "checked_steps": checked["sync"] + checked["overlap"],
        "load_errors": load_errors,
        "load_hit_pages": stats.get("load_hit_pages"),
        "reps": reps,
        "shape": {
            k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in shape.__dict__.items()
        },
        **common,
    }
    emit(
        summary,
        f"hidden_fraction {summary['hidden_fraction']} "
        f"(of medians {summary['hidden_fraction_of_medians']}), "
        f"layer compute {summary['layer_compute_ms']} ms vs load {summary['layer_load_ms']} ms, "
        f"wrong bytes {total_wrong}, load errors {len(load_errors)}",
    )
    return 1 if total_wrong or load_errors else 0


if __name__ == "__main__":
    sys.exit(main())
