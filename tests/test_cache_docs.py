"""docs/embedding.md cannot rot: its complete example runs, its options table is current."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest

from kvtier.cache import CacheOptions
from kvtier.core.config_docs import config_reference_markdown

DOC = Path(__file__).resolve().parent.parent / "docs" / "embedding.md"


def _example() -> str:
    text = DOC.read_text(encoding="utf-8")
    match = re.search(r"## A complete example.*?```python\n(.*?)```", text, re.S)
    assert match, "docs/embedding.md lost its '## A complete example' python block"
    return match.group(1)


def test_embedding_example_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the example's temp root
    exec(compile(_example(), str(DOC), "exec"), {"__name__": "embedding_example"})
    out = capsys.readouterr().out
    assert "request 2: 4 of 8 pages from the cache" in out
    assert "storage hits" in out


def test_embedding_options_table_matches_the_model() -> None:
    text = DOC.read_text(encoding="utf-8")
    match = re.search(r"<!-- cache-options:start -->\n(.*?)<!-- cache-options:end -->", text, re.S)
    assert match, "docs/embedding.md lost its generated CacheOptions table markers"
    assert match.group(1) == config_reference_markdown(CacheOptions), (
        "the CacheOptions table in docs/embedding.md is stale; regenerate it with "
        "kvtier.core.config_docs.config_reference_markdown(kvtier.cache.CacheOptions)"
    )
