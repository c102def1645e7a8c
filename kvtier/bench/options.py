"""What every ``kvtier bench`` workload shares: its options and the engine config.

Both workloads (``single`` and ``multiturn``) take the same storage, transfer-plan,
geometry and run options, and build their engine config from them the same way (so a
geometry flag of the other attention kind is refused the same way).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.core.config import EngineConfig, load_engine_config
from kvtier.core.errors import InvalidFieldError
from kvtier.core.geometry import AttentionKind

if TYPE_CHECKING:
    from kvtier.plugins.registry import Registry

__all__ = [
    "GB",
    "GEOMETRY_DEFAULTS",
    "WORKLOAD_OPTIONS",
    "add_common_arguments",
    "check_workload_options",
    "engine_config",
    "remember_defaults",
    "temporary_root",
]

#: Bytes in a GB as reported (decimal, like disk vendors and `dd`).
GB = 1e9
#: The bench's default geometry per attention kind: an 8B-class model, 8 MiB pages.
GEOMETRY_DEFAULTS: dict[AttentionKind, dict[str, int]] = {
    AttentionKind.MHA: {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128},
    AttentionKind.MLA: {"num_layers": 32, "kv_lora_rank": 512, "qk_rope_head_dim": 64},
}


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """The storage, transfer-plan, geometry and run options of every workload."""
    store = parser.add_argument_group("storage")
    store.add_argument(
        "--backend", default="file", help="storage backend (see `kvtier backends`); default file"
    )
    store.add_argument(
        "--extra-config",
        default=None,
        metavar="JSON|@FILE",
        help="the backend's options as a JSON object or @file.json/@file.toml; for backends "
        "with a 'root' option (file, uring) it defaults to a temporary directory removed "
        "afterwards",
    )
    store.add_argument(
        "--verify",
        choices=("full", "header"),
        default="full",
        help="page verification on get: full payload checksum or header only (default full)",
    )
    plan = parser.add_argument_group("transfer plan")
    plan.add_argument("--io-backend", default="auto", help="device <-> host mover (default auto)")
    plan.add_argument(
        "--layout",
        default="auto",
        help="host-pool layout: layer_first, page_first, page_first_direct, page_head, or auto",
    )
    plan.add_argument(
        "--device",
        default=None,
        help="torch device of the device pool: cpu, cuda, cuda:N (default: cuda if "
        "available, else cpu); checked before the run",
    )
    geo = parser.add_argument_group("geometry (default: an 8B-class model, 8 MiB pages)")
    geo.add_argument("--attention", choices=("mha", "mla"), default="mha")
    geo.add_argument("--num-layers", type=int, default=None, help="default 32")
    geo.add_argument("--num-kv-heads", type=int, default=None, help="MHA, default 8")
    geo.add_argument("--head-dim", type=int, default=None, help="MHA, default 128")
    geo.add_argument("--kv-lora-rank", type=int, default=None, help="MLA, default 512")
    geo.add_argument("--qk-rope-head-dim", type=int, default=None, help="MLA, default 64")
    geo.add_argument("--dtype", default="bfloat16", help="default bfloat16")
    geo.add_argument("--page-size", type=int, default=64, help="tokens per page; default 64")
    run_ = parser.add_argument_group("run")
    run_.add_argument("--pages", type=int, default=64, help="pages per round; default 64")
    run_.add_argument(
        "--batch",
        type=int,
        default=None,
        help="pages per put/get call, as an engine batches them (default 8, at most "
        "--pages; latency is per call)",
    )
    run_.add_argument(
        "--raw-threads",
        type=int,
        default=None,
        help="threads of the second raw baseline (default: the backend's io_threads, else 4)",
    )
    run_.add_argument("--rounds", type=int, default=3, help="timed rounds after a warm-up")
    run_.add_argument("--seed", type=int, default=0, help="seed of the random KV, 0 to 2**62 - 1")
    run_.add_argument("--no-raw", action="store_true", help="skip the raw pwritev/preadv side")
    run_.add_argument(
        "--workdir",
        default=None,
        help="directory for the temporary page files (default: the system temp dir)",
    )
    run_.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    run_.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress on stderr (default: a bar on a terminal, else a plain line every "
        "few seconds; the single workload is quiet with --json)",
    )
    run_.add_argument(
        "--workload",
        choices=("single", "multiturn"),
        default="single",
        help="single (default): back up and read back --pages pages; multiturn: simulated "
        "conversations sharing prefixes through TieredCache (options below)",
    )


#: The options only one workload reads (``--plot`` is checked along with its file).
WORKLOAD_OPTIONS: dict[str, tuple[str, ...]] = {
    "single": ("pages", "batch", "raw_threads", "rounds", "no_raw"),
    "multiturn": (
        "conversations",
        "turns",
        "system_tokens",
        "turn_tokens",
        "host_pages",
        "write_policy",
        "prefetch_policy",
    ),
}


def remember_defaults(parser: argparse.ArgumentParser) -> None:
    """Keep the defaults of :data:`WORKLOAD_OPTIONS` in the parsed args, to see what was set."""
    dests = [dest for names in WORKLOAD_OPTIONS.values() for dest in names]
    parser.set_defaults(_bench_defaults={dest: parser.get_default(dest) for dest in dests})


def check_workload_options(args: argparse.Namespace, workload: str) -> None:
    """Refuse an option of the other workload, which this run would silently ignore."""
    defaults: dict[str, Any] | None = getattr(args, "_bench_defaults", None)
    if defaults is None:  # args not built by kvtier bench's parser
        return
    for other, dests in WORKLOAD_OPTIONS.items():
        if other == workload:
            continue
        for dest in dests:
            value = getattr(args, dest, defaults[dest])
            if value != defaults[dest]:
                flag = "--" + dest.replace("_", "-")
                raise InvalidFieldError(
                    flag,
                    f"is an option of the {other} workload, but this run is the {workload} "
                    f"workload, which would ignore it; add --workload {other}, or drop {flag}",
                    value=value,
                )


def engine_config(
    args: argparse.Namespace, extra: dict[str, Any], *, model: str, host_pages: int
) -> EngineConfig:
    """The engine config the options describe; a flag of the other attention kind is refused."""
    attention = AttentionKind(args.attention)
    defaults = GEOMETRY_DEFAULTS[attention]
    data: dict[str, Any] = {
        "backend": args.backend,
        "io_backend": args.io_backend,
        "layout": args.layout,
        "attention": attention.value,
        "dtype": args.dtype,
        "page_size": args.page_size,
        "verify": args.verify,
        "model": model,
        "host_pages": host_pages,
        "extra_config": extra,
    }
    for name, default in defaults.items():
        value = getattr(args, name)
        data[name] = default if value is None else value
    other = AttentionKind.MLA if attention is AttentionKind.MHA else AttentionKind.MHA
    for name in GEOMETRY_DEFAULTS[other]:
        if name not in defaults and getattr(args, name) is not None:
            flag = "--" + name.replace("_", "-")
            raise InvalidFieldError(
                name,
                f"{flag} is a {other.value.upper()} geometry option but --attention is "
                f"{attention.value}; drop it or change --attention",
                value=getattr(args, name),
            )
    return load_engine_config(data)


def temporary_root(
    registry: Registry, backend: str, extra: dict[str, Any], workdir: Path
) -> dict[str, Any]:
    """``extra`` with a throw-away ``root`` under ``workdir`` for backends that take one."""
    spec = registry.backends.get(backend)
    if spec is not None and "root" in spec.config_model.model_fields and "root" not in extra:
        return {**extra, "root": str(workdir / "pages")}
    return extra
