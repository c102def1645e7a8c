"""Key vLLM's own request objects with kvtier's scheduler and print the keys as JSON.

``python tests/vllm_engine/request_keys.py ADAPTER_A ADAPTER_B``, with the vLLM
environment's python. Builds real ``vllm.v1.request.Request`` objects (text, images as
``MultiModalFeatureSpec`` with ``PlaceholderRange``, ``LoRARequest`` adapters, prompt
embeddings) and prints ``{case: [page keys]}`` on the last line, for
``tests/test_vllm_inputs.py`` to compare.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace
from typing import Any

import torch
from vllm import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.request import Request

from kvtier.integrations.vllm import VLLMSection
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


def main() -> None:
    adapter_a, adapter_b = sys.argv[1], sys.argv[2]
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
    print(json.dumps(keys))


if __name__ == "__main__":
    main()
