"""Build hook: compile kvtier's C extensions into the wheel.

Two modules, each compiled from every C file in its own source directory (one file a
job) plus the code they share, one copy of each file in ``kvtier/_csrc/``: the envelope
(writing one and the verdict on one, ``envelope.c``/``envelope.h``; its layout,
``envelope_layout.h``, the values of ``kvtier.core.envelope_layout``), BLAKE2b and the
xxHash binding (``kvhash.h``), the Python glue (``glue.h``):

- ``kvtier.backends.filestore._pageio`` (``_pageio_src/``): the file backends' per-page
  loop (open, move, checksum and envelope, publish);
- ``kvtier.core._envelope`` (``kvtier/core/_envelope_src/``): the core's batch calls to
  the envelope code, which ``PageStore`` uses for every backend without a loop of its own.

Needs a C compiler (``cc``, or ``$CC``) and Python's headers; nothing else (xxHash is
bound at import from the ``xxhash`` package). Where either is missing the wheel is built
without the module that failed, and kvtier runs the Python code it replaces;
``KVTIER_REQUIRE_COMPILED=1`` makes any failure a build error instead (CI sets it).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any, NamedTuple

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

#: The C files every extension compiles in (one copy each) and the headers they share.
SHARED = Path("kvtier/_csrc")


class Extension(NamedTuple):
    """One compiled module: where it goes, its own sources, and what runs without it.

    (A NamedTuple, not a dataclass: hatchling loads this file without registering it as
    a module, which dataclasses need.)
    """

    package: Path
    name: str
    sources: Path
    what: str
    fallback: str

    def target(self, suffix: str) -> Path:
        return self.package / (self.name + suffix)


EXTENSIONS = (
    Extension(
        Path("kvtier/backends/filestore"),
        "_pageio",
        Path("kvtier/backends/filestore/_pageio_src"),
        "the compiled page loop",
        "the file backends will use their own loops",
    ),
    Extension(
        Path("kvtier/core"),
        "_envelope",
        Path("kvtier/core/_envelope_src"),
        "the compiled envelope code",
        "PageStore will write and verify envelopes in Python",
    ),
)


def _compile(root: Path, extension: Extension, suffix: str) -> str:
    """Build one extension in place; an empty string, or why it was not built."""
    own = sorted((root / extension.sources).glob("*.c"))
    if not own:
        return f"no C sources in {extension.sources}"
    sources = [*own, *sorted((root / SHARED).glob("*.c"))]
    compiler = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
    command = [
        *compiler,
        "-O2",
        "-Wall",
        "-shared",
        "-fPIC",
        "-fvisibility=hidden",  # one module: only its PyInit_ is exported
        f"-I{sysconfig.get_paths()['include']}",
        f"-I{root / extension.sources}",
        f"-I{root / SHARED}",
        *(str(source) for source in sources),
        "-o",
        str(root / extension.target(suffix)),
        "-ldl",
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
    except OSError as exc:
        return str(exc)
    if done.returncode:  # (a compiler may fail without a word on stderr)
        return done.stderr.strip() or f"{compiler[0]} exited {done.returncode}"
    return ""


class CompiledLoopHook(BuildHookInterface):
    """Compiles every extension next to its sources and ships them in a platform wheel."""

    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel":
            return
        root = Path(self.root)
        suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
        for extension in EXTENSIONS:
            error = _compile(root, extension, suffix)
            if error:
                message = f"kvtier: {extension.what} was not built ({error})"
                if os.environ.get("KVTIER_REQUIRE_COMPILED") == "1":
                    raise RuntimeError(message)
                print(f"{message}; {extension.fallback}", file=sys.stderr)
                continue
            build_data["pure_python"] = False
            build_data["infer_tag"] = True
            build_data["artifacts"].append(extension.target(suffix).as_posix())
