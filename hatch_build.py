"""Build hook: compile the file backend's per-page loop (``_pageio``) into the wheel.

Needs a C compiler (``cc``, or ``$CC``) and Python's headers; nothing else (xxHash is
bound at import from the ``xxhash`` package). Where either is missing the wheel is built
without it and the backend runs its Python loop; ``KVTIER_REQUIRE_COMPILED=1`` makes that
a build error instead (CI sets it).
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

SOURCE = Path("kvtier/backends/filestore/_pageio.c")


class CompiledLoopHook(BuildHookInterface):
    """Compiles ``_pageio`` next to its source and ships it as a platform wheel."""

    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel":
            return
        root = Path(self.root)
        suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
        target = SOURCE.with_name("_pageio" + suffix)
        compiler = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
        command = [
            *compiler,
            "-O2",
            "-Wall",
            "-shared",
            "-fPIC",
            f"-I{sysconfig.get_paths()['include']}",
            str(root / SOURCE),
            "-o",
            str(root / target),
            "-ldl",
        ]
        try:
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            error = done.stderr.strip() if done.returncode else ""
        except OSError as exc:
            error = str(exc)
        if error:
            message = f"kvtier: the compiled page loop was not built ({error})"
            if os.environ.get("KVTIER_REQUIRE_COMPILED") == "1":
                raise RuntimeError(message)
            print(f"{message}; the file backend will use its Python loop", file=sys.stderr)
            return
        build_data["pure_python"] = False
        build_data["infer_tag"] = True
        build_data["artifacts"].append(target.as_posix())
