"""SGLang's pages are keyed by what the server computes the KV with, not by the model's name.

SGLang hands storage only a model name; the adapter reads the model settings SGLang
published in the server's process (``runtime_context.get_model()``) and keys them with
core's ``identify``, as vLLM's are. The plan-level tests run anywhere, on objects with
SGLang's attribute names; the last ones publish real ``ServerArgs`` through SGLang's own
``override_server_args`` and drive its ``HiCacheController`` (SGLang test environment,
``tests/test_sglang_env.py``).
"""

from __future__ import annotations

import json
import logging
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from test_model_identity import hub_repo

from kvtier.core.errors import UnsupportedCombinationError
from kvtier.integrations.sglang.model import model_name
from kvtier.integrations.sglang.plan import SGLangSetup
from kvtier.integrations.sglang.settings import SGLangSection
from kvtier.plugins.manager import default_registry


def _local_model(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"hidden_size": 64, "rope_theta": 10000.0}))
    (root / "model.safetensors").write_bytes(b"weights")
    return root


def _settings(model_path: str, **changes: Any) -> Any:
    """SGLang's published model settings (namespace ``model``) with their defaults."""
    fields: dict[str, Any] = {
        "model_path": model_path,
        "revision": None,
        "load_format": "auto",
        "dtype": "auto",
        "quantization": None,
        "quantization_param_path": None,
        "kv_cache_dtype": "auto",
        "json_model_override_args": "{}",
        "modelopt_quant": None,
        "model_impl": "auto",
        "download_dir": None,
    }
    fields.update(changes)
    return SimpleNamespace(**fields)


def _storage_config(name: str) -> Any:
    return SimpleNamespace(
        model_name=name, is_mla_model=False, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1
    )


def _namespace(published: Any, name: str = "served", **section: Any) -> str:
    """The namespace id of the KV pool's plan of an SGLang rank under ``published``."""
    setup = SGLangSetup.for_rank(
        _storage_config(name),
        SGLangSection(backend="memory", **section),
        default_registry(),
        published,
    )
    plan = setup.resolve(
        layout="page_first",
        num_layers=2,
        num_kv_heads=1,
        head_dim=8,
        dtype="bfloat16",
        page_size=16,
    )
    return plan.namespace.id


def test_sglang_configs_differing_only_in_quantization_get_their_own_namespaces(
    tmp_path: Path,
) -> None:
    model = str(_local_model(tmp_path / "model"))
    plain = _namespace(_settings(model))
    assert plain == _namespace(_settings(model))
    assert _namespace(_settings(model, quantization="fp8")) != plain
    assert _namespace(_settings(model, quantization="fp8")) != _namespace(
        _settings(model, quantization="w8a8_int8")
    )


@pytest.mark.parametrize(
    "change",
    [
        {"dtype": "float16"},
        {"kv_cache_dtype": "fp8_e4m3"},
        {"json_model_override_args": '{"rope_scaling": {"rope_type": "yarn", "factor": 4}}'},
        {"json_model_override_args": '{"rope_theta": 500000}'},
        {"modelopt_quant": "fp8"},
        {"load_format": "safetensors"},
    ],
    ids=lambda change: next(iter(change)),
)
def test_sglang_settings_that_change_the_kv_change_the_key(
    tmp_path: Path, change: dict[str, Any]
) -> None:
    model = str(_local_model(tmp_path / "model"))
    assert model_name("served", None, _settings(model, **change)) != model_name(
        "served", None, _settings(model)
    )


def test_sglang_overrides_are_keyed_as_data_not_as_text(tmp_path: Path) -> None:
    model = str(_local_model(tmp_path / "model"))
    a = _settings(model, json_model_override_args='{"a": 1, "b": {"c": 2}}')
    b = _settings(model, json_model_override_args='{ "b": {"c": 2},  "a": 1 }')
    assert model_name("served", None, a) == model_name("served", None, b)


def test_sglang_kv_scales_file_is_keyed_by_its_contents(tmp_path: Path) -> None:
    model = str(_local_model(tmp_path / "model"))
    scales = tmp_path / "kv_scales.json"
    scales.write_text('{"k": 0.5}')
    first = model_name("served", None, _settings(model, quantization_param_path=str(scales)))
    scales.write_text('{"k": 0.25}')
    assert model_name("served", None, _settings(model, quantization_param_path=str(scales))) != (
        first
    )


def test_sglang_weights_are_keyed_by_content_in_every_sub_folder(tmp_path: Path) -> None:
    model = _local_model(tmp_path / "model")
    (model / "shards").mkdir()
    shard = model / "shards" / "model-00002.safetensors"
    shard.write_bytes(b"shard v1")
    first = model_name("served", None, _settings(str(model)))
    shard.write_bytes(b"shard v2, retrained")
    assert model_name("served", None, _settings(str(model))) != first


def test_sglang_hub_model_is_keyed_by_the_snapshot_it_loaded(tmp_path: Path) -> None:
    cache = tmp_path / "hub"
    files = {"config.json": b'{"hidden_size": 64}', "model.safetensors": b"weights v1"}
    snapshot = hub_repo(cache, "org/model", "a" * 40, files)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("a" * 40)
    published = _settings("org/model", download_dir=str(cache))
    first = model_name("org/model", None, published)
    assert first.startswith("org/model#")
    # main moves to new weights: SGLang loads the new snapshot, kvtier keys it apart
    hub_repo(cache, "org/model", "b" * 40, {**files, "model.safetensors": b"weights v2"})
    (snapshot.parent.parent / "refs" / "main").write_text("b" * 40)
    assert model_name("org/model", None, published) != first


def test_sglang_model_that_cannot_be_keyed_is_refused_at_start_up(tmp_path: Path) -> None:
    hub = _settings("org/not-downloaded", download_dir=str(tmp_path / "empty"))
    with pytest.raises(UnsupportedCombinationError) as refused:
        _namespace(hub)
    message = str(refused.value)
    assert "cannot key the pages of model 'served'" in message
    assert "--revision COMMIT" in message and '"kvtier": {"model": "NAME"}' in message
    # a declared identity is the operator's name for the weights
    assert _namespace(hub, model="served@v1") != _namespace(
        _settings("org/not-downloaded", quantization="fp8"), model="served@v1"
    )
    model = str(_local_model(tmp_path / "model"))
    with pytest.raises(UnsupportedCombinationError, match="--load-format dummy"):
        _namespace(_settings(model, load_format="dummy"))


def test_sglang_storage_outside_a_server_keys_the_name_and_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # nothing published (a storage built outside an SGLang server): the name as before
    with caplog.at_level(logging.WARNING, logger="kvtier.sglang"):
        assert model_name("test/outside-a-server", None, None) == "test/outside-a-server"
    assert "published no model settings" in caplog.text
    assert "give each configuration its own kvtier.model" in caplog.text
    model = _local_model(tmp_path / "model")
    first = model_name(str(model), None, None)
    assert first.startswith(f"{model}#")
    (model / "model.safetensors").write_bytes(b"weights, retrained")
    assert model_name(str(model), None, None) != first


# --- SGLang's own classes ---------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["file", "mooncake"])
def test_sglang_server_args_of_two_quantizations_never_share_a_page(
    backend: str, tmp_path: Path
) -> None:
    """Two SGLang servers on one store (a shared file root, one Mooncake cluster),
    differing only in ``--quantization``: the second finds none of the first's pages; a
    third like the first finds them all."""
    from sglang_host_pool import sglang_or_skip

    sglang_or_skip()
    from sglang.srt.runtime_context import get_context
    from sglang_host_pool import Controller, mha_host_pool, storage_config
    from test_sglang import _fill, _hashes, extra_config

    from kvtier.testing import require
    from kvtier.testing.mooncake import MooncakeMaster, mooncake_unavailable_reason, use_client_env

    model = str(_local_model(tmp_path / "model"))
    made: list[Any] = []
    with ExitStack() as stack:
        if backend == "mooncake":
            require("mooncake", mooncake_unavailable_reason())  # KVTIER_REQUIRE_MOONCAKE
            use_client_env()
            master = stack.enter_context(MooncakeMaster(storage_node_bytes=64 << 20))
            extra = extra_config("memory", None)
            extra["kvtier"] = {
                "backend": "mooncake",
                "extra_config": {"master_address": master.address, "global_segment_size": 0},
            }
        else:
            extra = extra_config("file", tmp_path / "store")

        def server(quantization: str | None) -> tuple[Any, Any]:
            pool = mha_host_pool()
            config = storage_config(extra_config=extra, layout=pool.layout, model_name=model)
            with get_context().override_server_args(model_path=model, quantization=quantization):
                controller = Controller.attach(config, pool)
            made.append(controller)
            return controller, pool

        try:
            first, pool = server(None)
            hashes = _hashes(2, pool.page_size)
            assert first.backup(hashes, _fill(pool, 2)[0]) == 2 * pool.page_size
            assert server("fp8")[0].hit_query(hashes) == []
            assert server(None)[0].hit_query(hashes) == hashes
        finally:
            for controller in made:
                controller.close()
