"""The ``kvtier`` command: list backends, check a configuration, run benchmarks.

``kvtier check`` resolves a configuration exactly as an engine does at start-up (same
parser, same validation, same capability resolution), so an operator learns before
launching a server whether the plan works, and if not, what would.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import json
import logging
import sys
import textwrap
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from kvtier._version import __version__
from kvtier.core.capabilities import ResolvedPlan, resolve
from kvtier.core.config import (
    AUTO,
    DEFAULT_BACKEND,
    describe_fields,
    load_engine_config,
    parse_extra_config,
)
from kvtier.core.errors import KvtierError
from kvtier.core.geometry import AttentionKind
from kvtier.core.layout import Layout
from kvtier.core.specs import BackendSpec, IOBackendSpec, Operation

if TYPE_CHECKING:
    from kvtier.plugins.registry import PluginInfo, Registry

__all__ = ["EXIT_ERROR", "EXIT_OK", "build_parser", "main"]

EXIT_OK = 0
#: A configuration that was rejected, a plugin that failed, a command not available.
EXIT_ERROR = 2

#: Stopped by Ctrl-C (128 + SIGINT, as shells report it).
EXIT_INTERRUPTED = 130

#: JSON output format version of ``kvtier backends --json`` and ``kvtier check --json``.
JSON_FORMAT = 1

_EPILOG = """\
examples:
  kvtier backends
      every storage and IO backend: plugin, version, availability, capabilities, options
  kvtier backends --json
      the same as stable JSON, for scripts
  kvtier check --backend memory --num-layers 32 --num-kv-heads 8 --head-dim 128
      resolve a plan the way an engine does at start-up and print it
  kvtier check --backend memory --extra-config '{"capacity_bytes": 1073741824}'
      check a backend's own options (JSON in single quotes, so the shell keeps the ")
  kvtier check --config @engine.toml --io-backend kernel --layout page_first
      a whole engine config from a file, with two fields overridden
  kvtier bench --help
      benchmarks (when this build has them)

exit status: 0 when the command succeeded, 2 when a configuration was rejected or a
plugin failed; the reason goes to stderr, never a traceback.
"""

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

_BACKENDS_EPILOG = """\
For each backend: the plugin and distribution that declared it, whether it can run here
(and if not, what to install), the layouts / attention kinds / operations / IO backends it
supports, its features, and its options (the keys of --extra-config) with types and
defaults. For each IO backend: its priority for `auto` and which operations it executes
for each layout and attention kind.

Plugins come from entry points of group "kvtier"; KVTIER_DISABLE_PLUGIN_AUTOLOAD=1 lists
only the built-ins and KVTIER_DISABLE_PLUGINS=name,... blocks some.
"""


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line: what was wrong, where to look."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_ERROR, f"{self.prog}: error: {message}; see '{self.prog} --help'\n")


def _unrecognized(parser: argparse.ArgumentParser, extra: list[str]) -> str:
    """The usage error for ``extra``, with the closest option when one was misspelt."""
    message = f"unrecognized arguments: {' '.join(extra)}"
    known = [flag for action in parser._actions for flag in action.option_strings]
    for arg in extra:
        if arg.startswith("--"):
            close = difflib.get_close_matches(arg.split("=")[0], known, n=1)
            if close:
                return f"{message} (did you mean {close[0]}?)"
    return message


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the hand-wrapped examples; wide enough for the option table."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=32, width=100)


# --- registry --------------------------------------------------------------------------


def _load_registry() -> Registry:
    """The registry of installed plugins (imported here: the CLI sits on top of plugins)."""
    from kvtier.plugins.manager import load_registry

    return load_registry()


def _origin(registry: Registry, kind: str, name: str) -> PluginInfo | None:
    try:
        return registry.origin(kind, name)
    except KeyError:
        return None


# --- kvtier backends -------------------------------------------------------------------


def _sorted_values(values: Any) -> list[str]:
    return sorted(str(getattr(v, "value", v)) for v in values)


def _operation_order(values: Any) -> list[str]:
    present = {str(getattr(v, "value", v)) for v in values}
    return [op.value for op in Operation if op.value in present]


def _origin_dict(info: PluginInfo | None) -> dict[str, Any]:
    return {
        "plugin": info.plugin if info else None,
        "distribution": info.distribution if info else None,
        "version": info.version if info else None,
    }


def _availability(spec: BackendSpec | IOBackendSpec) -> dict[str, Any]:
    reason = spec.unavailable_reason()
    return {
        "available": reason is None,
        "unavailable_reason": reason,
        "install_hint": spec.install_hint or None,
    }


def _config_fields(spec: BackendSpec | IOBackendSpec) -> list[dict[str, Any]]:
    return [
        {
            "name": doc.name,
            "type": doc.type,
            "required": doc.required,
            "default": doc.default,
            "description": doc.description,
        }
        for doc in describe_fields(spec.config_model)
    ]


def _backend_dict(registry: Registry, spec: BackendSpec) -> dict[str, Any]:
    return {
        "name": spec.name,
        **_origin_dict(_origin(registry, "backend", spec.name)),
        "description": spec.description,
        **_availability(spec),
        "requires": list(spec.requires),
        "layouts": _sorted_values(spec.layouts),
        "attention": _sorted_values(spec.attention),
        "operations": _operation_order(spec.operations),
        "io_backends": None if spec.io_backends is None else sorted(spec.io_backends),
        "features": _sorted_values(spec.features),
        "config": _config_fields(spec),
    }


def _io_backend_dict(registry: Registry, spec: IOBackendSpec) -> dict[str, Any]:
    capabilities = sorted(
        spec.capabilities,
        key=lambda c: (c.layout.value, c.attention.value, list(Operation).index(c.operation)),
    )
    return {
        "name": spec.name,
        **_origin_dict(_origin(registry, "io_backend", spec.name)),
        "description": spec.description,
        **_availability(spec),
        "requires": list(spec.requires),
        "priority": spec.priority,
        "devices": sorted(spec.devices),
        "capabilities": [
            {
                "layout": c.layout.value,
                "attention": c.attention.value,
                "operation": c.operation.value,
            }
            for c in capabilities
        ],
        "config": _config_fields(spec),
    }


def backends_report(registry: Registry) -> dict[str, Any]:
    """Everything ``kvtier backends`` shows, as JSON-friendly data, sorted by name."""
    return {
        "format": JSON_FORMAT,
        "backends": [
            _backend_dict(registry, registry.backends[n]) for n in sorted(registry.backends)
        ],
        "io_backends": [
            _io_backend_dict(registry, registry.io_backends[n])
            for n in sorted(registry.io_backends)
        ],
    }


def _origin_text(entry: dict[str, Any]) -> str:
    if entry["plugin"] is None:
        return "(unknown plugin)"
    if entry["distribution"]:
        return f"{entry['plugin']} ({entry['distribution']} {entry['version'] or '?'})"
    return str(entry["plugin"])


def _status_text(entry: dict[str, Any]) -> str:
    if entry["available"]:
        return "available"
    return f"UNAVAILABLE: {entry['unavailable_reason']}"


def _list(values: list[str] | None, empty: str = "(none)") -> str:
    return ", ".join(values) if values else empty


def _wrap(label: str, text: str, indent: int = 4) -> list[str]:
    head = f"{' ' * indent}{label:<13}"
    return textwrap.wrap(
        text, width=96, initial_indent=head, subsequent_indent=" " * len(head)
    ) or [head]


def _fields_table(fields: list[dict[str, Any]], indent: int = 6) -> list[str]:
    if not fields:
        return [f"{' ' * indent}(no options)"]
    rows = [
        (
            f["name"],
            f["type"],
            "required" if f["required"] else f"default {json.dumps(f['default'])}",
            f["description"],
        )
        for f in fields
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(2)]
    pad = " " * indent
    lines = []
    for r in rows:
        lines.append(f"{pad}{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]}".rstrip())
        lines += textwrap.wrap(
            r[3], width=96, initial_indent=pad + "    ", subsequent_indent=pad + "    "
        )
    return lines


def _capability_matrix(entry: dict[str, Any], indent: int = 6) -> list[str]:
    if not entry["capabilities"]:
        return [f"{' ' * indent}(declares no capabilities)"]
    have = {(c["layout"], c["attention"], c["operation"]) for c in entry["capabilities"]}
    ops = [op.value for op in Operation]
    rows = [
        (f"{lay.value}/{att.value}", lay.value, att.value)
        for att in AttentionKind
        for lay in Layout
        if any((lay.value, att.value, op) in have for op in ops)
    ]
    first = max(len("layout/attention"), *(len(r[0]) for r in rows))
    pad = " " * indent
    lines = [f"{pad}{'layout/attention':<{first}}  " + "  ".join(ops)]
    for label, lay, att in rows:
        cells = "  ".join(f"{'x' if (lay, att, op) in have else '-':<{len(op)}}" for op in ops)
        lines.append(f"{pad}{label:<{first}}  {cells}".rstrip())
    return lines


def _entry_head(entry: dict[str, Any], suffix: str = "") -> list[str]:
    """The lines every listed backend starts with: name, status, install hint, origin."""
    lines = ["", f"  {entry['name']}  [{_status_text(entry)}]{suffix}"]
    if not entry["available"] and entry["install_hint"]:
        lines += _wrap("install:", entry["install_hint"])
    lines += _wrap("plugin:", _origin_text(entry))
    if entry["description"]:
        lines += _wrap("description:", entry["description"])
    return lines


def render_backends(report: dict[str, Any]) -> str:
    """The human-readable listing of :func:`backends_report`."""
    lines = [f"Storage backends ({len(report['backends'])})"]
    for entry in report["backends"]:
        lines += _entry_head(entry)
        lines += _wrap("layouts:", _list(entry["layouts"]))
        lines += _wrap("attention:", _list(entry["attention"]))
        lines += _wrap("operations:", _list(entry["operations"]))
        lines += _wrap("io backends:", _list(entry["io_backends"], "any"))
        lines += _wrap("features:", _list(entry["features"]))
        lines.append("    options (--extra-config keys):")
        lines += _fields_table(entry["config"])
    lines += ["", f"IO backends ({len(report['io_backends'])})"]
    for entry in report["io_backends"]:
        lines += _entry_head(entry, f"  priority {entry['priority']}")
        lines += _wrap("devices:", _list(entry["devices"]))
        lines.append("    capabilities (x = executes):")
        lines += _capability_matrix(entry)
        if entry["config"]:
            lines.append("    options:")
            lines += _fields_table(entry["config"])
    return "\n".join(lines) + "\n"


def _cmd_backends(args: argparse.Namespace, registry: Registry) -> int:
    report = backends_report(registry)
    if args.json:
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
    else:
        sys.stdout.write(render_backends(report))
    return EXIT_OK


# --- kvtier check ----------------------------------------------------------------------

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
    plan = resolve(config, registry.backends, registry.io_backends)
    return plan, notes


def _cmd_check(args: argparse.Namespace, registry: Registry) -> int:
    try:
        plan, notes = check_config(args, registry)
    except KvtierError as exc:
        if args.json:
            sys.stdout.write(json.dumps(_error_json(exc), indent=2) + "\n")
        _print_error(exc)
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


def _print_error(exc: BaseException) -> None:
    sys.stderr.write(f"kvtier: error: {exc}\n")


# --- kvtier bench ----------------------------------------------------------------------


def _add_bench(sub: Any) -> None:
    """Delegate ``kvtier bench`` to :mod:`kvtier.bench`, or say why it cannot run.

    A missing or broken benchmark module only disables ``kvtier bench``; every other
    command keeps working.
    """
    bench: Any = None
    reason = ""
    try:
        # importlib rather than "from kvtier import bench": mypy passes with or without it.
        bench = importlib.import_module("kvtier.bench")
        if not (
            callable(getattr(bench, "add_arguments", None))
            and callable(getattr(bench, "run", None))
        ):
            raise AttributeError("kvtier.bench must define add_arguments(parser) and run(args)")
    except Exception as exc:
        missing = isinstance(exc, ImportError) and exc.name in ("kvtier", "kvtier.bench")
        reason = (
            "kvtier bench is not available yet in this build (there is no kvtier.bench module)"
            if missing
            else f"kvtier bench cannot start: importing kvtier.bench failed: {exc!r}"
        )
        bench = None
    doc = (getattr(bench, "__doc__", None) or "Run kvtier benchmarks.").strip()
    parser = sub.add_parser(
        "bench",
        help="run benchmarks" if bench is not None else "run benchmarks (not available)",
        description=doc if bench is not None else reason,
        formatter_class=_Formatter,
    )
    if bench is not None:
        try:
            bench.add_arguments(parser)
        except Exception as exc:
            reason = f"kvtier bench cannot start: kvtier.bench.add_arguments failed: {exc!r}"
        else:
            parser.set_defaults(_kvtier_run=bench.run, _kvtier_parser=parser)
            return

    def unavailable(args: argparse.Namespace) -> int:
        sys.stderr.write(f"kvtier: error: {reason}\n")
        return EXIT_ERROR

    # Whatever arguments were meant for the benchmarks are accepted and ignored.
    parser.set_defaults(_kvtier_run=unavailable, _kvtier_any_args=True)


# --- entry point -----------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The ``kvtier`` argument parser with every subcommand."""
    parser = _Parser(
        prog="kvtier",
        description="kvtier: tiered, pluggable KV-cache storage for LLM serving engines.\n"
        "List the installed backends, check a configuration before starting an engine, "
        "run benchmarks.",
        epilog=_EPILOG,
        formatter_class=_Formatter,
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="log kvtier's decisions (what `auto` picked) to stderr",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="_kvtier_command", metavar="COMMAND", required=True)
    backends = sub.add_parser(
        "backends",
        help="list storage and IO backends, their plugins, capabilities and options",
        description="List every storage backend and IO backend the installed plugins declare.",
        epilog=_BACKENDS_EPILOG,
        formatter_class=_Formatter,
    )
    backends.add_argument("--json", action="store_true", help="stable JSON instead of text")
    backends.set_defaults(_kvtier_registry_cmd=_cmd_backends, _kvtier_parser=backends)
    check = sub.add_parser(
        "check",
        help="validate a configuration the way an engine does at start-up",
        description="Validate a whole kvtier configuration and print the resolved plan.",
        epilog=_CHECK_EPILOG,
        formatter_class=_Formatter,
    )
    _add_check_arguments(check)
    check.set_defaults(_kvtier_registry_cmd=_cmd_check, _kvtier_parser=check)
    _add_bench(sub)
    return parser


def main(argv: Sequence[str] | None = None, *, registry: Registry | None = None) -> int:
    """Run the ``kvtier`` command; returns the exit status (0 ok, 2 rejected).

    ``registry`` replaces the installed plugins (for tests and embedding engines).
    """
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
        if extra and not getattr(args, "_kvtier_any_args", False):
            sub: argparse.ArgumentParser = getattr(args, "_kvtier_parser", parser)
            sub.error(_unrecognized(sub, extra))
    except SystemExit as exc:  # --help, --version, or a usage error argparse printed
        return exc.code if isinstance(exc.code, int) else EXIT_ERROR
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("kvtier")
    if args.verbose:
        logger.addHandler(handler)
        previous = logger.level
        logger.setLevel(logging.INFO)
    try:
        run: Callable[[argparse.Namespace], int] | None = getattr(args, "_kvtier_run", None)
        if run is not None:
            try:
                return int(run(args))
            except KvtierError as exc:  # a bench that did not catch its own config error
                _print_error(exc)
                return EXIT_ERROR
            except KeyboardInterrupt:
                sys.stderr.write("kvtier: interrupted\n")
                return EXIT_INTERRUPTED
        command: Callable[[argparse.Namespace, Registry], int] = args._kvtier_registry_cmd
        try:
            loaded = registry if registry is not None else _load_registry()
        except KvtierError as exc:
            _print_error(exc)
            return EXIT_ERROR
        return command(args, loaded)
    finally:
        if args.verbose:
            logger.removeHandler(handler)
            logger.setLevel(previous)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
