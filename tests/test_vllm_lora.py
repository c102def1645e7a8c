"""A real vLLM engine never serves one LoRA adapter's KV to another, nor to the base model.

Two random adapters (PEFT format, on every layer's q/k/v projections) and the base tiny
Llama run the same tokens. Each must produce exactly the tokens it produces without a
connector, through one kvtier store that already holds the pages another one computed,
and a request with the same adapter in a new engine must still hit. Before the adapter
was in the page key, the second engine served adapter A's pages to B and to the base
model (512 tokens reported cached, A's continuation returned).
"""

from __future__ import annotations

import random
import subprocess
from pathlib import Path
from typing import Any

import pytest
from test_model_identity import hub_repo
from test_vllm import BLOCK, ROOT, Engine, _phases, _vllm_python

ADAPTER = ROOT / "tests" / "vllm_engine" / "tiny_lora.py"
TINY_MODEL = ROOT / "tests" / "vllm_engine" / "tiny_model.py"
PROMPT = [random.Random(22).randrange(1, 500) for _ in range(552)]
PAGES = (len(PROMPT) - 1) // BLOCK


@pytest.fixture(scope="module")
def lora_engine(tmp_path_factory: pytest.TempPathFactory) -> tuple[Engine, dict[str, Any]]:
    python = _vllm_python()
    model = tmp_path_factory.mktemp("tiny-llama-lora")
    subprocess.run([str(python), str(TINY_MODEL), str(model)], check=True, timeout=300)
    adapters: dict[str, Any] = {}
    for name, seed, int_id in (("adapter-a", 1, 1), ("adapter-b", 2, 2)):
        path = tmp_path_factory.mktemp(name)
        subprocess.run([str(python), str(ADAPTER), str(model), str(path), str(seed)], check=True)
        adapters[name] = {"name": name, "id": int_id, "path": str(path)}
    return Engine(python, model, tmp_path_factory.mktemp("vllm-lora-jobs")), adapters


def _phase(name: str, adapter: dict[str, Any] | None) -> dict[str, Any]:
    return {"name": name, "prompts": [PROMPT], "lora": adapter, "max_tokens": 12}


def _job(connector: dict[str, Any] | None, phases: list[dict[str, Any]]) -> dict[str, Any]:
    job: dict[str, Any] = {"lora": {"max_rank": 8}, "prefix_caching": True, "phases": phases}
    if connector is None:
        return {**job, "connector": None}
    return {**job, "connector": "kvtier", "kvtier": connector}


def test_each_adapter_and_the_base_model_get_their_own_kv(
    lora_engine: tuple[Engine, dict[str, Any]], tmp_path: Path
) -> None:
    engine, adapters = lora_engine
    a, b = adapters["adapter-a"], adapters["adapter-b"]
    runs = [("base", None), ("a", a), ("b", b)]
    alone = _phases(engine.run(_job(None, [_phase(n, x) for n, x in runs])))
    tokens = {name: alone[name]["tokens"][0] for name, _ in runs}
    assert len({tuple(t) for t in tokens.values()}) == 3  # the adapters change the output

    section = {"backend": "file", "extra_config": {"root": str(tmp_path / "pages")}}
    first = _phases(engine.run(_job(section, [_phase("a", a)])))
    assert first["a"]["tokens"][0] == tokens["a"]
    assert first["a"]["worker"]["save_stored_pages"] >= PAGES

    # a new engine on the same store: B and the base model must not get A's pages
    second = _phases(
        engine.run(_job(section, [_phase(n, x) for n, x in (runs[2], runs[0], runs[1])]))
    )
    for name, _ in runs:
        assert second[name]["tokens"][0] == tokens[name], name
    assert second["b"]["cached"] == [0]
    assert second["base"]["cached"] == [0]
    # ... while A, new to this engine, still hits what the first engine stored
    assert second["a"]["cached"] == [PAGES * BLOCK]
    assert second["a"]["scheduler"]["lookup_hit_pages"] == PAGES
    assert second["a"]["worker"]["load_hit_pages"] == PAGES
    assert second["a"]["worker"]["load_failed_pages"] == 0


def _snapshot(cache: Path, adapter: dict[str, Any], commit: str) -> str:
    """``adapter``'s files as a hub download: ``snapshots/<commit>/FILE`` links into
    ``blobs/``, the folder vLLM is given as the adapter's ``lora_path``."""
    files = {p.name: p.read_bytes() for p in sorted(Path(adapter["path"]).iterdir())}
    return str(hub_repo(cache, "org/sql", commit, files))


def test_adapters_from_hub_snapshots_of_one_name_get_their_own_kv(
    lora_engine: tuple[Engine, dict[str, Any]], tmp_path: Path
) -> None:
    # two hub downloads named "sql" with other weights: every file of each is a link into
    # its blobs/, which kvtier once skipped, keying both by the name alone
    engine, adapters = lora_engine
    a = {
        "name": "sql",
        "id": 1,
        "path": _snapshot(tmp_path / "hub-a", adapters["adapter-a"], "a" * 40),
    }
    b = {
        "name": "sql",
        "id": 1,
        "path": _snapshot(tmp_path / "hub-b", adapters["adapter-b"], "b" * 40),
    }
    section = {"backend": "file", "extra_config": {"root": str(tmp_path / "pages")}}
    first = _phases(engine.run(_job(section, [_phase("a", a)])))
    assert first["a"]["worker"]["save_stored_pages"] >= PAGES
    # a new engine: B under the same name gets none of A's pages ...
    second = _phases(engine.run(_job(section, [_phase("b", b)])))
    assert second["b"]["cached"] == [0]
    assert second["b"]["scheduler"]["lookup_hit_pages"] == 0
    assert second["b"]["tokens"][0] != first["a"]["tokens"][0]
    # ... while A, from another download of the same blobs, hits what the first stored
    again = {**a, "path": _snapshot(tmp_path / "hub-a2", adapters["adapter-a"], "c" * 40)}
    third = _phases(engine.run(_job(section, [_phase("a", again)])))
    assert third["a"]["cached"] == [PAGES * BLOCK]
    assert third["a"]["worker"]["load_hit_pages"] == PAGES
    assert third["a"]["tokens"][0] == first["a"]["tokens"][0]
