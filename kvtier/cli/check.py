"""``kvtier check``: resolve a configuration exactly as an engine does at start-up.

Same parser, same validation, same capability resolution as an engine, so an operator
learns before launching a server whether the plan works, and if not, what would.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from kvtier.cli.common import (
    EXIT_ERROR,
    EXIT_OK,
    JSON_FORMAT,
    Formatter,
    Subcommands,
    print_error,
)
from kvtier.core.capabilities import ResolvedPlan, resolve
from kvtier.core.config import AUTO, DEFAULT_BACKEND, load_engine_config
from kvtier.core.errors import KvtierError
from kvtier.core.extra_config import parse_extra_config
from kvtier.core.layout import Layout
from kvtier.core.specs import Operation

if TYPE_CHECKING:
    from kvtier.plugins.registry import Registry

__all__ = ["add_command", "check_config"]

_CHECK_EPILOG = f"""\
The plan is resolved with the installed plugins, before anything is allocated: names
(with "did you mean"), availability (with the install hint), geometry, the backend's
extra-config, then the IO backend x layout x attention x operations combination. `auto`
for --io-backend / --layout picks the best working combination and says which.

Flags override the same fields of --config. Geometry left out is filled with defaults
(MHA: 32 layers, 8 KV heads, head_dim 128; MLA: 61 layers, kv_lora_rank 512,
qk_rope_head_dim 64) and the output says so; --strict-geometry refuses instead, as an
engine would.

examples:
  kvtier check
      the default backend ({DEFAULT_BACKEND!r}) with auto IO backend and layout
  kvtier check --attention mla --num-layers 61 --kv-lora-rank 512 --qk-rope-head-dim 64
  kvtier check --operations backup_all,load_all,load_layer --io-backend direct
  kvtier check --extra-config @memory.toml --json
  kvtier check --config '{{"backend": "memory", "num_layers": 4, "num_kv_heads": 2,
                           "head_dim": 64}}' --strict-geometry

exit status: 0 and the plan on stdout, or 2 and the reason on stderr.
"""


#: (flag dest, EngineConfig field) for every flag that overrides a config field.
_CHECK_FIELDS = (
    "backend",
    "io_backend",
    "layout",
    "attention",
    "num_layers",
    "num_kv_heads",
    "head_dim",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "dtype",
    "page_size",
    "tp_rank",
    "tp_size",
    "operations",
    "model",
    "tenant",
    "verify",
    "host_pages",
    "host_bytes",
    "extra_config",
)


def _operations(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _add_check_arguments(parser: argparse.ArgumentParser) -> None:
    ops = ", ".join(op.value for op in Operation)
    plan = parser.add_argument_group("plan")
    plan.add_argument(
        "--backend", metavar="NAME", help=f"storage backend (default {DEFAULT_BACKEND!r})"
    )
    plan.add_argument("--io-backend", metavar="NAME", help=f"IO backend, or {AUTO!r} (default)")
    plan.add_argument(
        "--layout",
        metavar="NAME",
        help=f"host-pool layout: {', '.join(lay.value for lay in Layout)}, or {AUTO!r} (default)",
    )
    plan.add_argument(
        "--operations",
        metavar="OP,OP",
        type=_operations,
        help=f"transfers the engine uses, comma-separated: {ops} (default backup_all,load_all)",
    )
    plan.add_argument(
        "--extra-config",
        metavar="JSON|@FILE",
        help="the backend's options: a JSON object, or @file.json / @file.toml",
    )
    plan.add_argument(
        "--config",
        metavar="JSON|@FILE",
        help="a whole engine config (JSON object or @file.json / @file.toml); "
        "flags override its fields",
    )
    geometry = parser.add_argument_group("geometry")
    geometry.add_argument("--attention", metavar="KIND", help="mha (default) or mla")
    geometry.add_argument("--num-layers", type=int, metavar="N")
    geometry.add_argument(
        "--num-kv-heads", type=int, metavar="N", help="MHA: KV heads on this rank"
    )
    geometry.add_argument("--head-dim", type=int, metavar="N", help="MHA")
    geometry.add_argument("--kv-lora-rank", type=int, metavar="N", help="MLA")
    geometry.add_argument("--qk-rope-head-dim", type=int, metavar="N", help="MLA")
    geometry.add_argument("--dtype", metavar="NAME", help="bfloat16 (default), float16, fp8, ...")
    geometry.add_argument("--page-size", type=int, metavar="TOKENS", help="default 64")
    geometry.add_argument(
        "--strict-geometry",
        action="store_true",
        help="refuse missing geometry instead of filling in defaults",
    )
    engine = parser.add_argument_group("engine")
    engine.add_argument("--tp-rank", type=int, metavar="R")
    engine.add_argument("--tp-size", type=int, metavar="N")
    engine.add_argument("--model", metavar="ID", help="model id for the key namespace")
    engine.add_argument("--tenant", metavar="SALT", help="tenant salt for the key namespace")
    engine.add_argument("--verify", metavar="MODE", help="full (default) or header")
    engine.add_argument("--host-pages", type=int, metavar="N")
    engine.add_argument("--host-bytes", type=int, metavar="BYTES")
    parser.add_argument("--json", action="store_true", help="print the plan (or error) as JSON")


def check_config(args: argparse.Namespace, registry: Registry) -> tuple[ResolvedPlan, list[str]]:
    """Build the config from ``--config`` and flags, resolve it; returns (plan, notes)."""
    overrides = {
        name: getattr(args, name) for name in _CHECK_FIELDS if getattr(args, name) is not None
    }
    if args.extra_config is not None:  # parsed here so that errors name the flag
        overrides["extra_config"] = parse_extra_config(args.extra_config, source="--extra-config")
    config = load_engine_config(args.config, overrides=overrides, source="--config")
    notes: list[str] = []
    if not args.strict_geometry:
        config, notes = config.with_geometry_defaults()
    plan = resolve(config, registry.backends, registry.io_backends, policies=registry.policies)
    return plan, notes


def _cmd_check(args: argparse.Namespace, registry: Registry) -> int:
    try:
        plan, notes = check_config(args, registry)
    except KvtierError as exc:
        if args.json:
            sys.stdout.write(json.dumps(_error_json(exc), indent=2) + "\n")
        print_error(exc)
        return EXIT_ERROR
    if args.json:
        body = {"format": JSON_FORMAT, "ok": True, "plan": plan.to_dict(), "notes": notes}
        sys.stdout.write(json.dumps(body, indent=2) + "\n")
    else:
        sys.stdout.write("OK: the configuration resolves to this plan\n")
        sys.stdout.write(plan.summary() + "\n")
        for note in notes:
            sys.stdout.write(f"note: {note}\n")
    return EXIT_OK


def _error_json(exc: KvtierError) -> dict[str, Any]:
    return {"format": JSON_FORMAT, "ok": False, "error": type(exc).__name__, "message": str(exc)}


def add_command(sub: Subcommands) -> None:
    """Add ``kvtier check`` to the ``kvtier`` subcommands ``sub``."""
    check = sub.add_parser(
        "check",
        help="validate a configuration the way an engine does at start-up",
        description="Validate a whole kvtier configuration and print the resolved plan.",
        epilog=_CHECK_EPILOG,
        formatter_class=Formatter,
    )
    _add_check_arguments(check)
    check.set_defaults(kvtier_registry_cmd=_cmd_check, kvtier_parser=check)
