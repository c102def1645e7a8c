"""Key vLLM's own request and config objects with kvtier and print the results as JSON.

``python tests/vllm_engine/request_keys.py ADAPTER_A ADAPTER_B WORKDIR``, with the vLLM
environment's python, ``HF_HUB_CACHE=WORKDIR/hub`` and ``HF_HUB_OFFLINE=1``. Prints one
JSON object on the last line, for ``tests/test_vllm_inputs.py`` to compare:

- ``keys``: ``{case: [page keys]}`` of real ``vllm.v1.request.Request`` objects (text,
  images as ``MultiModalFeatureSpec`` with ``PlaceholderRange``, ``LoRARequest``
  adapters, prompt embeddings);
- ``hub``: what vLLM's own ``ModelConfig`` gives for a hub model id without
  ``--revision`` (the tiny Llama published into a local hub cache at one commit, then at
  another) and kvtier's model identity of each;
- ``refusals``: ``check_engine_inputs`` on vLLM's ``ModelConfig`` and ``CacheConfig`` of
  the tiny multimodal model (``tiny_mm_model.py``) with vLLM's caches on and off.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from vllm import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.request import Request

from kvtier.core.errors import UnsupportedCombinationError
from kvtier.integrations.vllm import VLLMSection
from kvtier.integrations.vllm.inputs import check_engine_inputs, model_identity
from kvtier.integrations.vllm.plan import resolve_plan
from kvtier.integrations.vllm.scheduler import SchedulerSide
from kvtier.plugins.manager import default_registry

PAGE = 32
TOKENS = list(range(1, 4 * PAGE + 2))


def _scheduler() -> SchedulerSide:
    spec = FullAttentionSpec(block_size=PAGE, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    group = SimpleNamespace(
        kv_cache_spec=spec, layer_names=["model.layers.0.a", "model.layers.1.a"]
    )
    vllm_config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_load_failure_policy="recompute"),
        model_config=SimpleNamespace(use_mla=False, model="tiny", revision="r1"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
    )
    settings = VLLMSection(backend="memory")
    plan = resolve_plan(
        vllm_config,
        SimpleNamespace(num_blocks=8, kv_cache_groups=[group]),
        settings,
        default_registry(),
        tp_rank=0,
    )

    class Everything:
        def exists(self, keys: list[str]) -> list[bool]:
            return [True] * len(keys)

    return SchedulerSide(plan, settings, Everything())  # type: ignore[arg-type]


def _image(identifier: str, offset: int) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(
        data=None,
        modality="image",
        identifier=identifier,
        mm_position=PlaceholderRange(offset=offset, length=40),
        mm_hash=identifier,
    )


def _request(name: str, tokens: list[int] | None = None, **more: Any) -> Request:
    return Request(
        request_id=name,
        prompt_token_ids=list(TOKENS) if tokens is None and "prompt_embeds" not in more else tokens,
        sampling_params=SamplingParams(max_tokens=4),
        pooling_params=None,
        **more,
    )


def _publish(repo: Path, commit: str, model: Path) -> None:
    """Put ``model``'s files into the hub cache ``repo`` as ``commit`` and point ``main`` at
    it, as a download of that commit would (snapshot links into content-named blobs)."""
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for file in sorted(model.iterdir()):
        if file.suffix not in (".json", ".safetensors"):
            continue
        blob = repo / "blobs" / f"{commit[:8]}-{file.name}"
        blob.write_bytes(file.read_bytes())
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)


def _hub(workdir: Path) -> dict[str, Any]:
    """vLLM's revision and kvtier's identity of a hub model id before and after ``main``
    moves to a new commit (weights retrained and pushed under the same name)."""
    from tiny_model import build
    from vllm.config import ModelConfig

    model = build(workdir / "tiny-llama")
    repo = Path(os.environ["HF_HUB_CACHE"]) / "models--kvtier-test--tiny-llama"
    out: dict[str, Any] = {}
    for commit in ("a" * 40, "b" * 40):
        _publish(repo, commit, model)
        config = ModelConfig(model="kvtier-test/tiny-llama", dtype="bfloat16")
        out[commit[0]] = {
            "revision": str(config.revision),
            "resolved": getattr(config.revision, "resolved", None),
            "identity": model_identity(config),
        }
    return out


def _refusals(workdir: Path) -> dict[str, str | None]:
    """``check_engine_inputs`` on vLLM's configs of a multimodal model: its message, or
    None when the engine is accepted."""
    from tiny_mm_model import build
    from vllm.config import CacheConfig, ModelConfig

    model = str(build(workdir / "tiny-idefics3"))
    out: dict[str, str | None] = {}
    for name, prefix, cache_gb in (
        ("both_off", False, 0),
        ("prefix_on", True, 0),
        ("processor_cache_on", False, 4),
    ):
        config = SimpleNamespace(
            model_config=ModelConfig(model=model, dtype="bfloat16", mm_processor_cache_gb=cache_gb),
            cache_config=CacheConfig(enable_prefix_caching=prefix),
        )
        try:
            check_engine_inputs(config)
            out[name] = None
        except UnsupportedCombinationError as exc:
            out[name] = str(exc)
    text = SimpleNamespace(
        model_config=ModelConfig(model=str(workdir / "tiny-llama"), dtype="bfloat16"),
        cache_config=CacheConfig(enable_prefix_caching=False),
    )
    check_engine_inputs(text)  # a text model: nothing to refuse
    return out


def main() -> None:
    adapter_a, adapter_b, workdir = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    embeds = torch.randn(
        len(TOKENS), 16, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(3)
    )
    changed = embeds.clone()
    changed[2 * PAGE + 5, 3] += 1
    cases = {
        "text": _request("text"),
        "cat": _request("cat", mm_features=[_image("cat-hash", 40)]),
        "dog": _request("dog", mm_features=[_image("dog-hash", 40)]),
        "cat_again": _request("cat_again", mm_features=[_image("cat-hash", 40)]),
        "cat_moved": _request("cat_moved", mm_features=[_image("cat-hash", 41)]),
        "lora_a": _request("lora_a", lora_request=LoRARequest("a", 1, adapter_a)),
        "lora_a_other_id": _request("lora_a2", lora_request=LoRARequest("a", 5, adapter_a)),
        "lora_b": _request("lora_b", lora_request=LoRARequest("b", 2, adapter_b)),
        "embeds": _request("embeds", prompt_embeds=embeds),
        "embeds_again": _request("embeds_again", prompt_embeds=embeds.clone()),
        "embeds_changed": _request("embeds_changed", prompt_embeds=changed),
    }
    side = _scheduler()
    keys = {name: side.request_keys(request, 4) for name, request in cases.items()}
    print(json.dumps({"keys": keys, "hub": _hub(workdir), "refusals": _refusals(workdir)}))


if __name__ == "__main__":
    main()
