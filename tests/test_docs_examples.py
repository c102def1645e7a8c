"""Every complete code example in the docs runs as written, so none can go stale.

The rules, which `docs/` follows:

- a ```` ```python ```` block runs as a script in a fresh directory and must exit 0;
- a block whose first line is ``# some/path.py`` (or ``# pyproject.toml``) is one file of
  a multi-file example: the doc's files are written out together, and each
  ``tests/test_*.py`` among them must pass under pytest;
- ``json`` and ``toml`` blocks must parse (a json block may be JSON lines, or the
  ``"key": value`` members of an object);
- in ``bash``/``sh``/``console`` blocks, every command that starts with ``kvtier`` runs and
  must exit 0;
- the line just before a fence may say otherwise, and must say why:
  ``<!-- not-run: REASON -->`` (fragments, GPU-only code, commands for other machines),
  ``<!-- run-by: tests/FILE.py -->`` (another test runs it, and must name the doc), or,
  for commands, ``<!-- exit: N -->`` (an example of a failure, exiting N).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
DOCS = (*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md")
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w-]*)\s*$")
MARKER = re.compile(r"^\s*<!--\s*(?P<kind>not-run|run-by|exit):\s*(?P<value>.*?)\s*-->\s*$")
FILE_HEADER = re.compile(r"^#\s+(?P<path>(?:[\w.-]+/)*[\w.-]+\.(?:py|toml))(?:\s|$)")
SCRIPT_TIMEOUT_S = 180
COMMAND_LANGS = {"bash", "sh", "shell", "console"}


@dataclass(frozen=True)
class Block:
    """One fenced block of a doc, with the marker on the line before it, if any."""

    doc: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    marker: tuple[str, str] | None

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"

    @property
    def file_path(self) -> str | None:
        """The path a block of a multi-file example belongs at, from its first line."""
        first = self.text.split("\n", 1)[0]
        match = FILE_HEADER.match(first)
        return match.group("path") if match else None

    @property
    def skipped(self) -> bool:
        return self.marker is not None and self.marker[0] in ("not-run", "run-by")


def _blocks(doc: Path) -> list[Block]:
    lines = doc.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, start = len(opening.group("indent")), i
        body: list[str] = []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        marker = MARKER.match(lines[start - 1]) if start else None
        blocks.append(
            Block(
                doc,
                start + 1,
                opening.group("lang").lower(),
                "\n".join(body) + "\n",
                (marker.group("kind"), marker.group("value")) if marker else None,
            )
        )
        i += 1
    return blocks


ALL_BLOCKS = [block for doc in DOCS for block in _blocks(doc)]


def _of(*langs: str) -> list[Block]:
    return [b for b in ALL_BLOCKS if b.lang in langs]


def _env(workdir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(workdir), env.get("PYTHONPATH")]))
    # `kvtier` resolves to this interpreter's console script, as installed with it.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.pop("PYTEST_ADDOPTS", None)
    return env


def _run(args: list[str], workdir: Path, what: str) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            args,
            cwd=workdir,
            env=_env(workdir),
            capture_output=True,
            text=True,
            timeout=SCRIPT_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{what} did not finish within {SCRIPT_TIMEOUT_S} s")


def _write_files(doc: Path, workdir: Path) -> list[str]:
    """Write out the doc's multi-file example; return the paths written."""
    paths = []
    for block in _blocks(doc):
        path = block.file_path
        if path is None or block.skipped or block.lang not in ("python", "toml"):
            continue
        target = workdir / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(block.text, encoding="utf-8")
        paths.append(path)
    return paths


# -- the markers themselves ----------------------------------------------------------------


def test_docs_have_examples_to_check() -> None:
    """The parser finds the docs' blocks, so an empty list cannot pass everything below."""
    assert len(_of("python")) >= 5
    assert any(b.file_path for b in ALL_BLOCKS)
    assert _of(*COMMAND_LANGS)


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_every_marker_sits_on_a_fence_and_says_why(doc: Path) -> None:
    lines = doc.read_text(encoding="utf-8").splitlines()
    for n, line in enumerate(lines):
        if "<!--" in line and re.search(r"<!--\s*(not-run|run-by|exit)\b", line):
            where = f"{doc.relative_to(ROOT)}:{n + 1}"
            match = MARKER.match(line)
            assert match, f"{where}: malformed marker {line.strip()!r}"
            assert n + 1 < len(lines) and FENCE.match(lines[n + 1]), (
                f"{where}: a marker must be on the line just before a ``` fence"
            )
            kind, value = match.group("kind"), match.group("value")
            if kind == "not-run":
                assert len(value.split()) >= 2, f"{where}: say why the block is not run"
            elif kind == "run-by":
                runner = ROOT / value
                assert runner.is_file(), f"{where}: run-by names a missing file {value!r}"
                assert doc.name in runner.read_text(encoding="utf-8"), (
                    f"{where}: {value} does not mention {doc.name}, so it cannot run its example"
                )
            else:
                assert value.isdigit(), f"{where}: exit wants a status number, got {value!r}"


# -- python --------------------------------------------------------------------------------

SCRIPTS = [b for b in _of("python") if b.file_path is None and not b.skipped]


@pytest.mark.parametrize("block", SCRIPTS, ids=lambda b: b.where)
def test_python_example_runs(block: Block, tmp_path: Path) -> None:
    _write_files(block.doc, tmp_path)
    script = tmp_path / "example.py"
    script.write_text(block.text, encoding="utf-8")
    result = _run([sys.executable, str(script)], tmp_path, block.where)
    assert result.returncode == 0, (
        f"{block.where}: the example exits {result.returncode}\n{result.stdout}\n{result.stderr}"
    )


MULTI_FILE_DOCS = sorted(
    {b.doc for b in _of("python") if b.file_path and not b.skipped}  # files with code
)


@pytest.mark.parametrize("doc", MULTI_FILE_DOCS, ids=lambda d: d.name)
def test_multi_file_example_passes_its_own_tests(doc: Path, tmp_path: Path) -> None:
    paths = _write_files(doc, tmp_path)
    tests = [p for p in paths if re.fullmatch(r"(.*/)?test_[\w]+\.py", p)]
    assert tests, f"{doc.name}: its multi-file example has no tests/test_*.py to run"
    for path in paths:
        if path.endswith(".py"):
            source = (tmp_path / path).read_text(encoding="utf-8")
            compile(source, path, "exec")  # a syntax error names the file, not a test
    pyproject = tmp_path / "pyproject.toml"
    if pyproject.exists():
        entry_points = tomllib.loads(pyproject.read_text())["project"]["entry-points"]["kvtier"]
        for module in entry_points.values():
            init = tmp_path / module.replace(".", "/") / "__init__.py"
            flat = tmp_path / (module.replace(".", "/") + ".py")
            assert init.exists() or flat.exists(), (
                f"{doc.name}: the entry point names {module!r}, which the example does not define"
            )
    result = _run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
        tmp_path,
        f"{doc.name}'s tests",
    )
    summary = result.stdout.strip().splitlines()[-1:] or ["(no output)"]
    assert result.returncode == 0, f"{doc.name}: its example fails its tests\n{result.stdout}"
    assert re.search(r"\d+ passed", summary[0]) and "skipped" not in summary[0], summary[0]


# -- json and toml -------------------------------------------------------------------------


def _parse_json(text: str) -> None:
    try:
        json.loads(text)
        return
    except json.JSONDecodeError as whole:
        lines = [line for line in text.splitlines() if line.strip()]
        try:
            for line in lines:
                json.loads(line)
            return
        except json.JSONDecodeError:
            pass
        try:
            json.loads("{" + text.strip().rstrip(",") + "}")  # members of an object
        except json.JSONDecodeError:
            raise whole from None


@pytest.mark.parametrize(
    "block", [b for b in _of("json", "toml") if not b.skipped], ids=lambda b: b.where
)
def test_config_example_parses(block: Block) -> None:
    if block.lang == "toml":
        tomllib.loads(block.text)
    else:
        _parse_json(block.text)


# -- commands ------------------------------------------------------------------------------


def _commands(block: Block) -> list[str]:
    """The ``kvtier ...`` commands of a shell block, continuation lines joined."""
    commands, current = [], ""
    for raw in block.text.splitlines():
        line = raw.rstrip()
        if block.lang == "console":
            if current:
                pass
            elif re.match(r"^\S*\$\s", line):
                line = re.sub(r"^\S*\$\s+", "", line)
            else:
                continue  # output, not a command
        current = f"{current} {line.strip()}" if current else line.strip()
        if current.endswith("\\"):
            current = current[:-1].rstrip()
            continue
        if re.match(r"^kvtier(\s|$)", current):
            commands.append(current)
        current = ""
    return commands


COMMANDS = [
    pytest.param(block, command, id=f"{block.where}:{command[:48]}")
    for block in _of(*COMMAND_LANGS)
    if not block.skipped
    for command in _commands(block)
]


@pytest.mark.parametrize(("block", "command"), COMMANDS)
def test_command_example_runs(block: Block, command: str, tmp_path: Path) -> None:
    assert shutil.which("bash"), "the command examples run under bash"
    _write_files(block.doc, tmp_path)
    want = int(block.marker[1]) if block.marker and block.marker[0] == "exit" else 0
    result = _run(["bash", "-c", command], tmp_path, f"{block.where}: {command}")
    assert result.returncode == want, (
        f"{block.where}: `{command}` exits {result.returncode}, the doc expects {want}\n"
        f"{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
    )
    if want:
        assert "Traceback" not in result.stderr, f"{block.where}: a failing example must not trace"
