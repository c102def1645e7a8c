"""Check kvtier's vLLM connector against the vLLM this interpreter imports.

    python scripts/check_vllm_api.py        # run with a vLLM environment's python

Imports every module of ``kvtier.integrations.vllm`` (each imports the vLLM names it
uses, so a name a release moved or removed fails here), then compares
``KvtierConnector`` with that release's ``KVConnectorBase_V1``:

- every abstract method is implemented;
- every method kvtier overrides takes the base's parameters, by name and kind, in order
  (vLLM calls some by keyword);
- a release that asks whether a connector follows sleep mode's KV cache remap
  (``supports_sleep_mode``) gets False: kvtier keeps views of the device KV cache, which
  sleep frees and remaps, so vLLM must refuse sleep mode with it rather than let a load
  or save touch memory that moved.

Prints one JSON object (the version, what was checked, the problems) and exits 1 when
there is a problem. ``scripts/check-vllm-release.sh VERSION`` runs it against a release
whose wheel cannot be installed here (the CUDA build of a newer vLLM), from its Python
sources.
"""

from __future__ import annotations

import importlib
import inspect
import json
import pkgutil
import sys
from typing import Any


def _parameters(function: Any) -> list[tuple[str, Any]]:
    return [(p.name, p.kind) for p in inspect.signature(function).parameters.values()]


def _own(cls: type, base: type, name: str) -> Any:
    """``cls``'s definition of ``name`` below ``base`` in its MRO, or None."""
    for klass in cls.__mro__:
        if klass is base:
            return None
        if name in vars(klass):
            return vars(klass)[name]
    return None


def check() -> dict[str, Any]:
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1 as Base

    import kvtier.integrations.vllm as package

    problems: list[str] = []
    modules = []
    for info in pkgutil.iter_modules(package.__path__):
        name = f"{package.__name__}.{info.name}"
        try:
            importlib.import_module(name)
            modules.append(name)
        except Exception as exc:  # a vLLM name this release does not have
            problems.append(f"importing {name}: {type(exc).__name__}: {exc}")
    from kvtier.integrations.vllm.connector import KvtierConnector

    for name in sorted(getattr(Base, "__abstractmethods__", ())):
        if _own(KvtierConnector, Base, name) is None:
            problems.append(f"{name}: abstract in vLLM's base class, not implemented")
    checked = []
    for name, member in vars(Base).items():
        ours = _own(KvtierConnector, Base, name)
        if ours is None or not callable(getattr(Base, name, None)):
            continue
        if isinstance(member, (classmethod, staticmethod)):
            member, ours = member.__func__, getattr(ours, "__func__", ours)
        if not inspect.isfunction(member) or not inspect.isfunction(ours):
            continue
        checked.append(name)
        theirs, mine = _parameters(member), _parameters(ours)
        if mine[: len(theirs)] != theirs and not any(
            kind == inspect.Parameter.VAR_KEYWORD for _, kind in mine
        ):
            problems.append(f"{name}: vLLM passes {theirs}, kvtier takes {mine}")
        passed = {n for n, _ in theirs}
        required = [
            n
            for n, p in inspect.signature(ours).parameters.items()
            if n not in passed
            and p.default is inspect.Parameter.empty
            and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        ]
        if required:
            problems.append(f"{name}: kvtier requires parameters vLLM never passes: {required}")
    if hasattr(Base, "supports_sleep_mode"):
        checked.append("supports_sleep_mode (answer)")
        if KvtierConnector.supports_sleep_mode(None) is not False:
            problems.append(
                "supports_sleep_mode: must answer False (kvtier keeps views of the device "
                "KV cache, which sleep mode frees and remaps)"
            )
    return {
        "vllm": vllm.__version__,
        "modules": len(modules),
        "methods_checked": sorted(checked),
        "problems": problems,
    }


def main() -> int:
    report = check()
    print(json.dumps(report, indent=1))
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
