"""Every request input that changes a vLLM page's KV is in its key (``integrations/vllm/inputs``).

These run without vLLM, on request objects with vLLM's attribute names; the same checks
on vLLM's own ``Request``, ``LoRARequest``, ``MultiModalFeatureSpec``, ``ModelConfig`` and
``CacheConfig`` run in the vLLM environment (``test_keys_of_real_vllm_requests``), and the
LoRA and image cases in a real engine (``tests/test_vllm_lora.py``,
``tests/test_vllm_multimodal.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from test_model_identity import hub_repo

from kvtier.core.errors import InvalidKeyError, UnkeyableInputError, UnsupportedCombinationError
from kvtier.core.keys import Namespace, PageKeyer
from kvtier.integrations.vllm import VLLMSection
from kvtier.integrations.vllm.inputs import (
    AdapterIdentities,
    check_engine_inputs,
    model_identity,
    page_extras,
)

ROOT = Path(__file__).resolve().parent.parent
PAGE = 32
TOKENS = list(range(1, 4 * PAGE + 2))  # four full pages and one token


@dataclass
class _Request:
    request_id: str
    all_token_ids: list[int] = field(default_factory=lambda: list(TOKENS))
    num_computed_tokens: int = 0
    cache_salt: str | None = None
    lora_request: Any = None
    mm_features: list[Any] = field(default_factory=list)
    prompt_embeds: torch.Tensor | None = None
    prompt_is_token_ids: list[bool] | None = None


def _image(identifier: str, offset: int, length: int = 40) -> Any:
    return SimpleNamespace(
        modality="image",
        identifier=identifier,
        mm_position=SimpleNamespace(offset=offset, length=length),
    )


def _adapter(tmp_path: Path, name: str, seed: int) -> Path:
    directory = tmp_path / name
    directory.mkdir()
    (directory / "adapter_config.json").write_text(json.dumps({"r": 8, "peft_type": "LORA"}))
    generator = torch.Generator().manual_seed(seed)
    (directory / "adapter_model.safetensors").write_bytes(
        torch.rand(256, generator=generator).numpy().tobytes()
    )
    return directory


def _lora(name: str, path: Path, int_id: int = 1) -> Any:
    return SimpleNamespace(lora_name=name, lora_int_id=int_id, lora_path=str(path))


class _Store:
    def exists(self, keys: list[str]) -> list[bool]:
        return [True] * len(keys)


def _scheduler() -> Any:
    from test_vllm import _plan

    from kvtier.integrations.vllm.scheduler import SchedulerSide

    return SchedulerSide(_plan(), VLLMSection(backend="memory"), _Store())


def _keys(request: _Request) -> list[str]:
    return list(_scheduler().request_keys(request, 4))


# --- the key chain takes per-page extras --------------------------------------------------


def test_extras_change_their_page_and_every_page_after_it() -> None:
    keyer = PageKeyer(Namespace("m", "fp"), PAGE)
    plain = keyer.keys(TOKENS)
    assert keyer.keys(TOKENS, extras=[None, None, None, None]) == plain
    assert keyer.keys(TOKENS, extras=[None, b"", None, None]) == plain
    marked = keyer.keys(TOKENS, extras=[None, b"image-a", None, None])
    assert marked[0] == plain[0]
    assert all(a != b for a, b in zip(marked[1:], plain[1:], strict=True))
    other = keyer.keys(TOKENS, extras=[None, b"image-b", None, None])
    assert other[0] == plain[0] and other[1] != marked[1]
    with pytest.raises(InvalidKeyError, match="3 entries for 4 full pages"):
        keyer.keys(TOKENS, extras=[None, None, None])


def test_extras_continue_from_a_parent_as_from_the_start() -> None:
    keyer = PageKeyer(Namespace("m", "fp"), PAGE)
    extras = [None, b"x", b"y", None]
    whole = keyer.keys(TOKENS, extras=extras)
    head = keyer.keys(TOKENS[: 2 * PAGE], extras=extras[:2])
    tail = keyer.keys(TOKENS[2 * PAGE : 4 * PAGE], parent=head[-1], extras=extras[2:])
    assert head + tail == whole


# --- LoRA adapters --------------------------------------------------------------------------


def test_each_adapter_and_the_base_model_key_their_own_pages(tmp_path: Path) -> None:
    a, b = _adapter(tmp_path, "a", 1), _adapter(tmp_path, "b", 2)
    base = _keys(_Request("base"))
    with_a = _keys(_Request("ra", lora_request=_lora("a", a)))
    with_b = _keys(_Request("rb", lora_request=_lora("b", b, int_id=2)))
    assert len({*base, *with_a, *with_b}) == 12  # no page shared by two of them
    assert _keys(_Request("ra2", lora_request=_lora("a", a, int_id=7))) == with_a  # id is no key


def test_an_adapter_is_keyed_by_its_contents_not_its_name_or_id(tmp_path: Path) -> None:
    # another deployment gives the same name and id to another adapter: no shared page
    a = _adapter(tmp_path, "a", 1)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    same_name = _adapter(elsewhere, "a", 9)
    first = _keys(_Request("r1", lora_request=_lora("a", a)))
    second = _keys(_Request("r2", lora_request=_lora("a", same_name)))
    assert not set(first) & set(second)
    # the same files under another path share pages; under another name they do not
    copy = tmp_path / "copy"
    copy.mkdir()
    for file in a.iterdir():
        (copy / file.name).write_bytes(file.read_bytes())
    assert _keys(_Request("r3", lora_request=_lora("a", copy))) == first
    assert not set(_keys(_Request("r4", lora_request=_lora("renamed", copy)))) & set(first)


def test_adapters_from_hub_snapshots_are_keyed_by_their_contents(tmp_path: Path) -> None:
    # a hub download: snapshots/<rev>/FILE -> ../../blobs/<sha>, every file a link
    config = b'{"r": 8, "peft_type": "LORA"}'
    one = hub_repo(
        tmp_path / "hub1",
        "org/sql",
        "a" * 40,
        {"adapter_config.json": config, "adapter_model.safetensors": b"weights one"},
    )
    two = hub_repo(
        tmp_path / "hub2",
        "org/sql",
        "b" * 40,
        {"adapter_config.json": config, "adapter_model.safetensors": b"weights two"},
    )
    same = hub_repo(
        tmp_path / "hub3",
        "org/sql",
        "c" * 40,
        {"adapter_config.json": config, "adapter_model.safetensors": b"weights one"},
    )
    assert all(p.is_symlink() for p in one.iterdir())
    first = _keys(_Request("r1", lora_request=_lora("sql", one)))
    assert not set(first) & set(_keys(_Request("r2", lora_request=_lora("sql", two))))
    assert _keys(_Request("r3", lora_request=_lora("sql", same))) == first
    identities = AdapterIdentities()
    assert identities(_lora("sql", one)) != identities(_lora("sql", two))


def test_an_adapter_link_that_leaves_its_folder_is_refused(tmp_path: Path) -> None:
    adapter = _adapter(tmp_path, "a", 1)
    (adapter / "adapter_model.safetensors").unlink()
    (adapter / "adapter_model.safetensors").symlink_to("/etc/hostname")
    side = _scheduler()
    request = _Request("linked", lora_request=_lora("a", adapter))
    with pytest.raises(UnkeyableInputError) as refused:
        side.request_keys(request, 4)
    message = str(refused.value)
    assert f"LoRA adapter 'a' at {str(adapter)!r}: kvtier cannot key it" in message
    assert f"{adapter / 'adapter_model.safetensors'} is a symbolic link to" in message
    assert "copy the files into the folder" in message
    side.add_request(request)
    assert side.matched_tokens(request, 0) == 0  # served without kvtier
    assert side.stats()["requests_unkeyed"] == 1


def test_an_adapter_rewritten_in_place_is_hashed_again(tmp_path: Path) -> None:
    identities = AdapterIdentities()
    a = _adapter(tmp_path, "a", 1)
    before = identities(_lora("a", a))
    weights = a / "adapter_model.safetensors"
    weights.write_bytes(b"\x01" + weights.read_bytes()[1:] + b"\x00")
    assert identities(_lora("a", a)) != before


def test_an_adapter_without_local_files_is_never_cached(tmp_path: Path) -> None:
    side = _scheduler()
    request = _Request("remote", lora_request=_lora("hub", tmp_path / "not-downloaded"))
    with pytest.raises(UnkeyableInputError) as refused:
        side.request_keys(request, 4)
    message = str(refused.value)  # the input, why, and what would work
    assert "LoRA adapter 'hub' has no local files at" in message
    assert "keys an adapter's pages by its files' contents" in message
    assert "give vLLM the adapter as a local directory (lora_path)" in message
    side.add_request(request)
    assert side.matched_tokens(request, 0) == 0  # served without kvtier: no hit
    work = side.step(
        new=[("remote", list(range(8)), 0)], cached=[], scheduled={"remote": 129}, preempted=[]
    )
    assert work.saves == []  # and nothing of it is stored
    assert side.stats()["requests_unkeyed"] == 1


# --- multimodal inputs and prompt embeddings -----------------------------------------------


def test_an_image_keys_the_pages_from_its_placeholders_on() -> None:
    # the image's placeholders take tokens 40..79: pages 1 and 2
    text = _keys(_Request("text"))
    cat = _keys(_Request("cat", mm_features=[_image("cat", 40)]))
    dog = _keys(_Request("dog", mm_features=[_image("dog", 40)]))
    assert cat[0] == dog[0] == text[0]  # the text before the image is still shared
    assert all(len({t, c, d}) == 3 for t, c, d in zip(text[1:], cat[1:], dog[1:], strict=True))
    assert _keys(_Request("cat2", mm_features=[_image("cat", 40)])) == cat
    moved = _keys(_Request("moved", mm_features=[_image("cat", 41)]))  # same image, shifted
    assert moved[0] == cat[0] and moved[1] != cat[1]


def test_page_extras_name_each_item_with_its_place_in_the_page() -> None:
    request = _Request("r", mm_features=[_image("cat", 40), _image("dog", 90, 10)])
    extras = page_extras(request, 0, 4, PAGE)
    assert extras is not None and extras[0] is None
    assert json.loads(extras[1] or b"") == [["mm", "cat", 8, 40]]
    assert json.loads(extras[2] or b"") == [["mm", "cat", -24, 40], ["mm", "dog", 26, 10]]
    assert json.loads(extras[3] or b"") == [["mm", "dog", -6, 10]]  # 96..99 of its 90..99
    assert page_extras(request, 3, 4, PAGE) == extras[3:]
    assert page_extras(_Request("plain"), 0, 4, PAGE) is None


def test_prompt_embeddings_key_their_pages() -> None:
    embeds = torch.randn(len(TOKENS), 16, dtype=torch.bfloat16)
    changed = embeds.clone()
    changed[2 * PAGE + 5, 3] += 1
    zeros = [0] * len(TOKENS)  # vLLM's token ids for an embeddings prompt
    first = _keys(_Request("e1", all_token_ids=zeros, prompt_embeds=embeds))
    again = _keys(_Request("e2", all_token_ids=zeros, prompt_embeds=embeds.clone()))
    other = _keys(_Request("e3", all_token_ids=zeros, prompt_embeds=changed))
    assert first == again
    assert first[:2] == other[:2] and first[2] != other[2] and first[3] != other[3]
    assert not set(first) & set(_keys(_Request("z", all_token_ids=zeros)))


def test_an_adapter_that_cannot_be_read_is_refused_with_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # root reads any file, so the unreadable file is a stat() that fails (a stand-in)
    def denied(path: Path) -> tuple[int, int]:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(AdapterIdentities, "_stamp", staticmethod(denied))
    with pytest.raises(UnkeyableInputError) as refused:
        AdapterIdentities()(_lora("a", _adapter(tmp_path, "a", 1)))
    message = str(refused.value)
    assert "LoRA adapter 'a' at" in message and "Permission denied" in message
    assert "make every file under lora_path readable" in message


def test_a_multimodal_input_without_a_content_hash_is_refused() -> None:
    request = _Request(
        "r",
        mm_features=[
            SimpleNamespace(
                modality="audio", identifier="", mm_position=SimpleNamespace(offset=40, length=30)
            )
        ],
    )
    with pytest.raises(UnkeyableInputError) as refused:
        page_extras(request, 0, 4, PAGE)
    message = str(refused.value)
    assert "the audio input at tokens 40..69 of request 'r' has no content hash" in message
    assert "keys the pages holding it by that hash" in message
    assert "pass multi_modal_uuids naming each audio item's content" in message
    side = _scheduler()  # the scheduler serves it without kvtier
    side.add_request(request)
    assert side.matched_tokens(request, 0) == 0
    assert side.stats()["requests_unkeyed"] == 1


def _engine(mm_cache_gb: float | None, prefix_caching: bool) -> Any:
    multimodal = None if mm_cache_gb is None else SimpleNamespace(mm_processor_cache_gb=mm_cache_gb)
    return SimpleNamespace(
        model_config=SimpleNamespace(multimodal_config=multimodal),
        cache_config=SimpleNamespace(enable_prefix_caching=prefix_caching),
    )


def test_an_engine_that_names_images_by_request_is_refused() -> None:
    # both of vLLM's caches off: vLLM skips hashing and names each item by request
    with pytest.raises(UnsupportedCombinationError) as refused:
        check_engine_inputs(_engine(0, prefix_caching=False))
    message = str(refused.value)
    assert "cannot key the multimodal inputs of this engine" in message
    assert "names it by request instead" in message
    assert "vLLM's prefix cache on" in message and "--mm-processor-cache-gb above 0" in message
    check_engine_inputs(_engine(0, prefix_caching=True))  # content hashes: accepted
    check_engine_inputs(_engine(4, prefix_caching=False))
    check_engine_inputs(_engine(None, prefix_caching=False))  # a text model


# --- the model ------------------------------------------------------------------------------


def _model_config(model: str, **changes: Any) -> Any:
    config = {"hidden_size": 128, "_name_or_path": model, "transformers_version": "5"}
    config.update(changes.pop("config", {}))
    return SimpleNamespace(
        model=model,
        revision=changes.get("revision"),
        dtype=changes.get("dtype", "bfloat16"),
        quantization=changes.get("quantization"),
        hf_config=SimpleNamespace(to_dict=lambda: dict(config)),
    )


def test_the_model_is_keyed_by_its_weights_not_only_its_name(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    weights = model / "model.safetensors"
    weights.write_bytes(b"weights v1")
    first = model_identity(_model_config(str(model)))
    assert first.startswith(f"{model}#")
    assert model_identity(_model_config(str(model))) == first
    weights.write_bytes(b"weights v2, retrained in place")
    assert model_identity(_model_config(str(model))) != first
    # what changes its KV besides weights: config, dtype, quantization, revision
    hub = model_identity(_model_config("org/model", revision="abc"))
    assert model_identity(_model_config("org/model", revision="def")) != hub
    assert model_identity(_model_config("org/model", revision="abc", dtype="float16")) != hub
    assert model_identity(_model_config("org/model", revision="abc", quantization="awq")) != hub
    rope = {"rope_scaling": {"type": "linear", "factor": 2.0}}
    assert model_identity(_model_config("org/model", revision="abc", config=rope)) != hub


def test_a_declared_model_id_is_shared_across_paths_and_weights(tmp_path: Path) -> None:
    # kvtier.model: the operator names the weights, so engines whose paths differ share
    here, there = tmp_path / "a", tmp_path / "b"
    for path, data in ((here, b"one copy"), (there, b"another copy")):
        path.mkdir()
        (path / "model.safetensors").write_bytes(data)
    one = model_identity(_model_config(str(here)), "llama-3-8b@v2")
    assert one == model_identity(_model_config(str(there)), "llama-3-8b@v2")
    assert one.startswith("llama-3-8b@v2#")
    # the config still counts: another architecture never shares a declared id's pages
    other = _model_config(str(there), config={"hidden_size": 256})
    assert model_identity(other, "llama-3-8b@v2") != one


class _Resolved(str):
    """huggingface_hub's ``ResolvedRevision`` as vLLM 0.32 leaves it in ``revision`` (its
    value the name asked for, ``resolved`` the commit); the real one is checked in
    ``test_keys_of_real_vllm_requests``."""

    resolved: str

    def __new__(cls, commit: str) -> _Resolved:
        value = super().__new__(cls, "main")
        value.resolved = commit
        return value


def test_a_hub_model_is_keyed_by_the_commit_its_revision_resolved_to() -> None:
    first = model_identity(_model_config("org/model", revision=_Resolved("a" * 40)))
    pushed = model_identity(_model_config("org/model", revision=_Resolved("b" * 40)))
    assert first != pushed  # "main" both times, two commits: two sets of pages
    assert first == model_identity(_model_config("org/model", revision="a" * 40))


def test_a_hub_model_without_a_revision_is_refused_at_start_up() -> None:
    with pytest.raises(UnsupportedCombinationError) as refused:
        model_identity(_model_config("org/model"))
    message = str(refused.value)
    assert "cannot key the pages of model 'org/model'" in message
    assert "not a local model directory" in message and "resolved no revision" in message
    assert "--revision COMMIT" in message and "a local model directory as --model" in message
    assert '"kvtier": {"model": "NAME"}' in message
    # a declared identity needs neither
    assert model_identity(_model_config("org/model"), "model@v1").startswith("model@v1#")


def test_hub_blobs_are_keyed_by_their_content_hash(tmp_path: Path) -> None:
    files = {"config.json": b"{}", "model.safetensors": b"weights"}
    first_snapshot = hub_repo(tmp_path / "hub1", "org/model", "a" * 40, files)
    second_snapshot = hub_repo(tmp_path / "hub2", "org/model", "b" * 40, files)
    for blob in (tmp_path / "hub1").rglob("blobs/*"):
        os.utime(blob, ns=(1, 1))  # another time: the blob's name is its content hash
    first = model_identity(_model_config(str(first_snapshot)), None)
    second = model_identity(_model_config(str(second_snapshot)), None)
    assert first.split("#")[1] == second.split("#")[1]  # the same blobs: the same digest


def test_weights_in_sub_folders_key_the_model(tmp_path: Path) -> None:
    model = tmp_path / "model"
    (model / "shards").mkdir(parents=True)
    (model / "config.json").write_text("{}")
    shard = model / "shards" / "model-00001-of-00001.safetensors"
    shard.write_bytes(b"weights v1")
    first = model_identity(_model_config(str(model)))
    shard.write_bytes(b"weights v2, retrained in place")
    assert model_identity(_model_config(str(model))) != first


def _cache(**changes: Any) -> Any:
    return SimpleNamespace(
        cache_dtype=changes.get("cache_dtype", "auto"), **changes.get("more", {})
    )


def test_the_kv_cache_settings_and_load_format_key_the_model() -> None:
    config = _model_config("org/model", revision="a" * 40)
    plain = model_identity(config, cache_config=_cache(), load_config=None)
    assert plain == model_identity(config, load_config=SimpleNamespace(load_format="auto"))
    changed = [
        model_identity(config, cache_config=_cache(cache_dtype="fp8_e4m3")),
        model_identity(config, cache_config=_cache(more={"calculate_kv_scales": True})),
        model_identity(config, cache_config=_cache(more={"kv_cache_dtype_skip_layers": ["0"]})),
        model_identity(config, load_config=SimpleNamespace(load_format="safetensors")),
    ]
    assert len({plain, *changed}) == 5


def test_dummy_weights_are_refused_at_start_up() -> None:
    with pytest.raises(UnsupportedCombinationError) as refused:
        model_identity(
            _model_config("org/model", revision="a" * 40),
            load_config=SimpleNamespace(load_format="dummy"),
        )
    assert "--load-format dummy" in str(refused.value)
    assert "--load-format auto (the real weights)" in str(refused.value)


def _engine_config(**parallel: int) -> Any:
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_load_failure_policy="recompute"),
        model_config=SimpleNamespace(use_mla=False, model="tiny", revision="r1"),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=1, pipeline_parallel_size=1, **parallel
        ),
    )


@pytest.mark.parametrize(
    ("field", "flag"),
    [
        ("decode_context_parallel_size", "--decode-context-parallel-size 1"),
        ("prefill_context_parallel_size", "--prefill-context-parallel-size 1"),
    ],
)
def test_context_parallelism_is_refused_at_start_up(field: str, flag: str) -> None:
    from test_vllm import _kv_cache_config

    from kvtier.integrations.vllm.plan import resolve_plan
    from kvtier.plugins.manager import default_registry

    def plan(size: int) -> Any:
        return resolve_plan(
            _engine_config(**{field: size}),
            _kv_cache_config(),
            VLLMSection(backend="memory"),
            default_registry(),
            tp_rank=0,
        )

    assert plan(1).namespace.model.startswith("tiny#")
    with pytest.raises(UnsupportedCombinationError) as refused:
        plan(2)
    message = str(refused.value)
    assert f"vLLM runs {field} 2 (context parallelism)" in message
    assert "interleaved share of every block's tokens" in message and flag in message


# --- vLLM's own request objects -------------------------------------------------------------


def test_keys_of_real_vllm_requests(tmp_path: Path) -> None:
    from test_vllm import _vllm_python

    python = _vllm_python()
    a, b = _adapter(tmp_path, "a", 1), _adapter(tmp_path, "b", 2)
    script = ROOT / "tests" / "vllm_engine" / "request_keys.py"
    hub = tmp_path / "hub"  # a local hub cache, offline: nothing is downloaded
    env = {**os.environ, "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [str(python), str(script), str(a), str(b), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    keys: dict[str, list[str]] = result["keys"]
    text, cat, dog = keys["text"], keys["cat"], keys["dog"]
    assert cat[0] == dog[0] == text[0]
    assert all(len({t, c, d}) == 3 for t, c, d in zip(text[1:], cat[1:], dog[1:], strict=True))
    assert keys["cat_again"] == cat
    assert keys["cat_moved"][1] != cat[1]
    assert len({*text, *keys["lora_a"], *keys["lora_b"]}) == 3 * len(text)
    assert keys["lora_a_other_id"] == keys["lora_a"]
    assert keys["embeds"] == keys["embeds_again"] != keys["embeds_changed"]
    assert keys["embeds"][0] == keys["embeds_changed"][0]
    # a hub id without --revision: vLLM resolves "main" to its commit, kvtier keys the
    # commit, so weights pushed under the same name are other pages
    before, after = result["hub"]["a"], result["hub"]["b"]
    assert before["revision"] == after["revision"] == "main"
    assert (before["resolved"], after["resolved"]) == ("a" * 40, "b" * 40)
    assert before["identity"] != after["identity"]
    # vLLM's configs with both caches off are refused; either cache on is accepted
    refusals = result["refusals"]
    assert "cannot key the multimodal inputs" in (refusals["both_off"] or "")
    assert refusals["prefix_on"] is None and refusals["processor_cache_on"] is None
