"""Build hook: compile the file backends' per-page loop (``_pageio``) into the wheel.

The extension is one module compiled from every C file in ``_pageio_src/`` (one file a
job, sharing ``pageio.h``). Needs a C compiler (``cc``, or ``$CC``) and Python's headers;
nothing else (xxHash is bound at import from the ``xxhash`` package). Where either is
missing the wheel is built without it and the backends run their own loops;
``KVTIER_REQUIRE_COMPILED=1`` makes that a build error instead (CI sets it).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

PACKAGE = Path("kvtier/backends/filestore")
#: The extension's sources: every ``.c`` file here, and the header they share.
SOURCES = PACKAGE / "_pageio_src"


class CompiledLoopHook(BuildHookInterface):
    """Compiles ``_pageio`` next to its sources and ships it as a platform wheel."""

    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel":
            return
        root = Path(self.root)
        suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
        target = PACKAGE / ("_pageio" + suffix)
        sources = sorted((root / SOURCES).glob("*.c"))
        compiler = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
        command = [
            *compiler,
            "-O2",
            "-Wall",
            "-shared",
            "-fPIC",
            "-fvisibility=hidden",  # one module: only PyInit__pageio is exported
            f"-I{sysconfig.get_paths()['include']}",
            *(str(source) for source in sources),
            "-o",
            str(root / target),
            "-ldl",
        ]
        error = f"no C sources in {SOURCES}" if not sources else ""
        try:
            if not error:
                done = subprocess.run(command, capture_output=True, text=True, check=False)
                if done.returncode:  # (a compiler may fail without a word on stderr)
                    error = done.stderr.strip() or f"{compiler[0]} exited {done.returncode}"
        except OSError as exc:
            error = str(exc)
        if error:
            message = f"kvtier: the compiled page loop was not built ({error})"
            if os.environ.get("KVTIER_REQUIRE_COMPILED") == "1":
                raise RuntimeError(message)
            print(f"{message}; the file backends will use their own loops", file=sys.stderr)
            return
        build_data["pure_python"] = False
        build_data["infer_tag"] = True
        build_data["artifacts"].append(target.as_posix())
