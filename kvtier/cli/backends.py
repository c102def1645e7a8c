"""``kvtier backends``: every storage and IO backend the installed plugins declare.

For each: the plugin and distribution that declared it, whether it can run here (and
if not, what to install), its capabilities and its options, as text or as stable JSON
(:func:`backends_report`), so an operator sees what a plan can use before writing one.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from typing import TYPE_CHECKING, Any

from kvtier.cli.common import EXIT_OK, JSON_FORMAT, Formatter, Subcommands
from kvtier.core.config_docs import describe_fields
from kvtier.core.geometry import AttentionKind
from kvtier.core.layout import Layout
from kvtier.core.specs import BackendSpec, IOBackendSpec, Operation, PolicySpec

if TYPE_CHECKING:
    from kvtier.plugins.registry import PluginInfo, Registry

__all__ = ["add_command", "backends_report", "render_backends"]

_BACKENDS_EPILOG = """\
For each backend: the plugin and distribution that declared it, whether it can run here
(and if not, what to install), the layouts / attention kinds / operations / IO backends it
supports, its features, and its options (the keys of --extra-config) with types and
defaults. For each IO backend: its priority for `auto` and which operations it executes
for each layout and attention kind.

Plugins come from entry points of group "kvtier"; KVTIER_DISABLE_PLUGIN_AUTOLOAD=1 lists
only the built-ins and KVTIER_DISABLE_PLUGINS=name,... blocks some.
"""


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


def _config_fields(spec: BackendSpec | IOBackendSpec | PolicySpec) -> list[dict[str, Any]]:
    """The options of ``spec``'s config model, one dict each."""
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
        "policies": [
            _policy_dict(registry, registry.policies[n]) for n in sorted(registry.policies)
        ],
    }


def _policy_dict(registry: Registry, spec: PolicySpec) -> dict[str, Any]:
    return {
        "name": spec.name,
        "kind": spec.kind,
        **_origin_dict(_origin(registry, "policy", spec.name)),
        "description": spec.description,
        "available": True,
        "unavailable_reason": None,
        "install_hint": None,
        "config": _config_fields(spec),
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
    lines += ["", f"Policies ({len(report['policies'])}: a tier's eviction or admission)"]
    for entry in report["policies"]:
        lines += _entry_head(entry, f"  {entry['kind']}")
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


def add_command(sub: Subcommands) -> None:
    """Add ``kvtier backends`` to the ``kvtier`` subcommands ``sub``."""
    backends = sub.add_parser(
        "backends",
        help="list storage and IO backends, their plugins, capabilities and options",
        description="List every storage backend and IO backend the installed plugins declare.",
        epilog=_BACKENDS_EPILOG,
        formatter_class=Formatter,
    )
    backends.add_argument("--json", action="store_true", help="stable JSON instead of text")
    backends.set_defaults(kvtier_registry_cmd=_cmd_backends, kvtier_parser=backends)
