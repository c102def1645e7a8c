"""What every ``kvtier bench`` workload shares: its options and the engine config.

Both workloads (``single`` and ``multiturn``) take the same storage, transfer-plan,
geometry and run options, and build their engine config from them the same way (so a
geometry flag of the other attention kind is refused the same way).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.core.config import DEFAULT_BACKEND, EngineConfig, load_engine_config
from kvtier.core.errors import InvalidFieldError, UnknownKeyError
from kvtier.core.extra_config import parse_extra_config
from kvtier.core.geometry import AttentionKind

if TYPE_CHECKING:
    from kvtier.plugins.registry import Registry

__all__ = [
    "CONFIG_FIELDS",
    "DEFAULT_BACKENDS",
    "GB",
    "GEOMETRY_DEFAULTS",
    "WORKLOAD_OPTIONS",
    "add_common_arguments",
    "backend_names",
    "chain_options",
    "check_workload_options",
    "engine_config",
    "remember_defaults",
    "temporary_root",
    "temporary_tier_roots",
]

#: Bytes in a GB as reported (decimal, like disk vendors and `dd`).
GB = 1e9
#: The backends each workload runs when --backend is not given: the single workload (the
#: README's main job) runs the file backend and the segment store beside it.
DEFAULT_BACKENDS: dict[str, tuple[str, ...]] = {
    "single": ("file", "segment"),
    "multiturn": (DEFAULT_BACKEND,),
}
#: The engine-config fields ``--config`` takes (every other one has a flag).
CONFIG_FIELDS = ("tiers", "tenants")
#: The flag that sets each engine-config field, to say so when --config names one.
_FLAG_OF = {
    "backend": "--backend",
    "extra_config": "--extra-config",
    "io_backend": "--io-backend",
    "layout": "--layout",
    "attention": "--attention",
    "dtype": "--dtype",
    "page_size": "--page-size",
    "verify": "--verify",
    "num_layers": "--num-layers",
    "num_kv_heads": "--num-kv-heads",
    "head_dim": "--head-dim",
    "kv_lora_rank": "--kv-lora-rank",
    "qk_rope_head_dim": "--qk-rope-head-dim",
}
#: The bench's default geometry per attention kind: an 8B-class model, 8 MiB pages.
GEOMETRY_DEFAULTS: dict[AttentionKind, dict[str, int]] = {
    AttentionKind.MHA: {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128},
    AttentionKind.MLA: {"num_layers": 32, "kv_lora_rank": 512, "qk_rope_head_dim": 64},
}


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """The storage, transfer-plan, geometry and run options of every workload."""
    store = parser.add_argument_group("storage")
    store.add_argument(
        "--backend",
        default=None,
        metavar="NAME[,NAME...]",
        help="storage backend(s) (see `kvtier backends`); several, comma-separated, run one "
        "after the other on the same pages and are reported side by side (single workload). "
        "Default: file,segment for the single workload (the file backend with the segment "
        "store beside it), file for multiturn",
    )
    store.add_argument(
        "--extra-config",
        default=None,
        metavar="JSON|@FILE",
        help="the backend's options as a JSON object or @file.json/@file.toml (with several "
        "backends, each gets them and checks them); for backends with a 'root' option (file, "
        "uring, segment) it defaults to a temporary directory removed afterwards",
    )
    store.add_argument(
        "--config",
        default=None,
        metavar="JSON|@FILE",
        help="engine-config fields the flags do not cover, as a JSON object or "
        "@file.json/@file.toml: 'tiers' (a chain of storage tiers, fastest first, instead "
        "of --backend/--extra-config; a tier with a 'root' option and none given gets a "
        "temporary one) and 'tenants' (per-tenant quotas); see docs/tiers.md",
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


def chain_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``tiers`` / ``tenants`` that ``--config`` gives (empty without it), checked.

    Only :data:`CONFIG_FIELDS` are taken; a field a flag sets is refused naming the flag,
    and ``tiers`` beside an explicit ``--backend`` or ``--extra-config`` is refused (each
    tier names its own backend and options). The values themselves are validated with the
    rest of the engine config, by :func:`engine_config`.
    """
    text = getattr(args, "config", None)
    if text is None:
        return {}
    data = parse_extra_config(text, source="--config")
    for name in data:
        if name in CONFIG_FIELDS:
            continue
        flag = _FLAG_OF.get(name)
        if flag is None:
            raise UnknownKeyError(name, where="--config", allowed=CONFIG_FIELDS)
        raise InvalidFieldError(
            f"--config.{name}",
            f"is set with {flag}, not in --config; --config takes {', '.join(CONFIG_FIELDS)}",
            value=data[name],
        )
    if "tiers" in data:
        for flag, dest in (("--backend", "backend"), ("--extra-config", "extra_config")):
            if getattr(args, dest, None) is not None:
                raise InvalidFieldError(
                    flag,
                    "give either --backend / --extra-config or 'tiers' in --config, not both: "
                    f"each tier names its backend and options; drop {flag}",
                    value=getattr(args, dest),
                )
    return data


def backend_names(args: argparse.Namespace, workload: str, chain: dict[str, Any]) -> list[str]:
    """The backends ``--backend`` names for ``workload`` (its default when not given).

    A chain from ``--config`` is one run of its own: no names. Several names are for the
    single workload; a repeated or empty name is refused.
    """
    if chain.get("tiers"):
        return []
    if args.backend is None:
        return list(DEFAULT_BACKENDS[workload])
    names = [name.strip() for name in str(args.backend).split(",")]
    if not all(names):
        raise InvalidFieldError(
            "--backend",
            f"{args.backend!r} has an empty name; give NAME or NAME,NAME,... "
            "(`kvtier backends` lists them)",
            value=args.backend,
        )
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise InvalidFieldError(
            "--backend",
            f"{repeated[0]!r} is listed twice; name each backend once",
            value=args.backend,
        )
    if len(names) > 1 and workload != "single":
        raise InvalidFieldError(
            "--backend",
            f"the {workload} workload runs one backend, got {len(names)} ({args.backend}); "
            "name one, or compare backends with the single workload",
            value=args.backend,
        )
    return names


def engine_config(
    args: argparse.Namespace,
    extra: dict[str, Any],
    *,
    model: str,
    host_pages: int,
    backend: str | None = None,
    chain: dict[str, Any] | None = None,
) -> EngineConfig:
    """The engine config the options describe; a flag of the other attention kind is refused.

    ``backend`` (with ``extra`` as its options) is the one storage backend, or ``chain``
    (from :func:`chain_options`, tiers given temporary roots by
    :func:`temporary_tier_roots`) gives the tiers and tenants. Everything goes through
    :func:`~kvtier.core.config.load_engine_config`, the one validated path.
    """
    attention = AttentionKind(args.attention)
    defaults = GEOMETRY_DEFAULTS[attention]
    data: dict[str, Any] = {
        "io_backend": args.io_backend,
        "layout": args.layout,
        "attention": attention.value,
        "dtype": args.dtype,
        "page_size": args.page_size,
        "verify": args.verify,
        "model": model,
        "host_pages": host_pages,
    }
    chain = chain or {}
    if not chain.get("tiers"):
        data["backend"] = backend or DEFAULT_BACKEND
        data["extra_config"] = extra
    data.update(chain)
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


def _has_root(registry: Registry, backend: str) -> bool:
    spec = registry.backends.get(backend)
    return spec is not None and "root" in spec.config_model.model_fields


def temporary_root(
    registry: Registry, backend: str, extra: dict[str, Any], workdir: Path, name: str = "pages"
) -> dict[str, Any]:
    """``extra`` with a throw-away ``root`` (``workdir/name``) for backends that take one."""
    if _has_root(registry, backend) and "root" not in extra:
        return {**extra, "root": str(workdir / name)}
    return extra


def temporary_tier_roots(
    registry: Registry, chain: dict[str, Any], workdir: Path
) -> tuple[dict[str, Any], int]:
    """``chain`` with a throw-away root for each tier whose backend takes one and has none;
    and how many tiers got one. A malformed tier is left as it is, for validation to name."""
    tiers = chain.get("tiers")
    if not isinstance(tiers, list):
        return chain, 0
    out, made = [], 0
    for i, tier in enumerate(tiers):
        if isinstance(tier, dict) and isinstance(tier.get("backend"), str):
            options = tier.get("extra_config", {})
            if isinstance(options, str):
                options = parse_extra_config(options, source=f"tiers[{i}].extra_config")
            if isinstance(options, dict) and _has_root(registry, tier["backend"]):
                if "root" not in options:
                    made += 1
                    options = {**options, "root": str(workdir / f"tier{i}-{tier['backend']}")}
                tier = {**tier, "extra_config": options}
        out.append(tier)
    return {**chain, "tiers": out}, made
