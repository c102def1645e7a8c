"""A real vLLM engine never serves the KV of one image to a prompt with another image.

A tiny random Idefics3 (``tests/vllm_engine/tiny_mm_model.py``: vision encoder, connector
and Llama, tokenizer and processor built locally) runs one text with two different
images. The two prompts have the same token ids: only the image differs, and only the
image's content hash in kvtier's page keys (``integrations/vllm/inputs.py``) tells their
pages apart. Through one kvtier store each image must produce exactly its own
no-connector tokens, the text before the image is still shared, and the same image in
a new engine hits every page; the negative control keys pages by tokens alone and shows
the second image then served the first image's KV.
"""

from __future__ import annotations

import random
import subprocess
from pathlib import Path
from typing import Any

import pytest
from test_vllm import BLOCK, ROOT, Engine, _phases, _vllm_python
from vllm_engine.tiny_mm_model import FIRST_WORD, IMAGE_TOKENS, VOCAB, text

TINY_MM_MODEL = ROOT / "tests" / "vllm_engine" / "tiny_mm_model.py"
_rng = random.Random(22)
BEFORE = [_rng.randrange(FIRST_WORD, VOCAB) for _ in range(40)]  # the image starts at 40
AFTER = [_rng.randrange(FIRST_WORD, VOCAB) for _ in range(141)]
TEXT = f"{text(BEFORE)} <image> {text(AFTER)}"
PROMPT_TOKENS = len(BEFORE) + IMAGE_TOKENS + len(AFTER)
PAGES = (PROMPT_TOKENS - 1) // BLOCK  # 6 full pages a hit can give
SHARED = len(BEFORE) // BLOCK  # pages before the image's first placeholder: 1
CAT, DOG = 1, 2  # the two images' seeds


@pytest.fixture(scope="module")
def mm_engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    python = _vllm_python()
    model = tmp_path_factory.mktemp("tiny-idefics3")
    subprocess.run([str(python), str(TINY_MM_MODEL), str(model)], check=True, timeout=300)
    return Engine(python, model, tmp_path_factory.mktemp("vllm-mm-jobs"))


def _phase(name: str, image: int, reset: bool = False) -> dict[str, Any]:
    return {
        "name": name,
        "prompts": [{"text": TEXT, "image": image}],
        "max_tokens": 12,
        "reset_prefix_cache": reset,
    }


def _job(section: dict[str, Any] | None, phases: list[dict[str, Any]]) -> dict[str, Any]:
    job: dict[str, Any] = {"multimodal": True, "prefix_caching": True, "phases": phases}
    if section is None:
        return {**job, "connector": None}
    return {**job, "connector": "kvtier", "kvtier": section}


@pytest.fixture(scope="module")
def alone(mm_engine: Engine) -> dict[str, dict[str, Any]]:
    """Each image's tokens from the engine without a connector."""
    result = _phases(mm_engine.run(_job(None, [_phase("cat", CAT), _phase("dog", DOG)])))
    cat, dog = result["cat"], result["dog"]
    # one token list for both prompts: a key of token ids alone cannot tell them apart
    assert cat["prompt_tokens"] == dog["prompt_tokens"]
    assert len(cat["prompt_tokens"][0]) == PROMPT_TOKENS
    assert cat["tokens"] != dog["tokens"]  # the image changes the output
    return result


def _section(root: Path) -> dict[str, Any]:
    return {"backend": "file", "extra_config": {"root": str(root)}}


def test_each_image_gets_its_own_kv_and_the_same_image_hits(
    mm_engine: Engine, alone: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    section = _section(tmp_path / "pages")
    first = _phases(mm_engine.run(_job(section, [_phase("cat", CAT)])))
    assert first["cat"]["tokens"] == alone["cat"]["tokens"]
    assert first["cat"]["worker"]["save_stored_pages"] >= PAGES

    # a new engine on the same store: the other image must not get the first one's pages
    second = _phases(
        mm_engine.run(_job(section, [_phase("dog", DOG), _phase("cat", CAT, reset=True)]))
    )
    dog, cat = second["dog"], second["cat"]
    assert dog["tokens"] == alone["dog"]["tokens"]
    assert dog["cached"] == [SHARED * BLOCK]  # only the text before the image is shared
    assert dog["scheduler"]["lookup_hit_pages"] == SHARED
    # ... while the same image, new to this engine, hits every page the first one stored
    assert cat["tokens"] == alone["cat"]["tokens"]
    assert cat["cached"] == [PAGES * BLOCK]
    assert cat["scheduler"]["lookup_hit_pages"] - dog["scheduler"]["lookup_hit_pages"] == PAGES
    assert cat["worker"]["load_hit_pages"] - dog["worker"]["load_hit_pages"] == PAGES
    assert cat["worker"]["load_failed_pages"] == 0
    assert cat["scheduler"]["requests_unkeyed"] == 0


def test_without_the_image_in_the_key_the_other_image_would_hit(
    mm_engine: Engine, alone: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    # the negative control: pages keyed by their tokens alone (hooks.py's no_page_extras)
    job = _job(_section(tmp_path / "pages"), [_phase("cat", CAT), _phase("dog", DOG, reset=True)])
    job["hooks"] = {"no_page_extras": True}
    result = _phases(mm_engine.run(job))
    assert result["cat"]["tokens"] == alone["cat"]["tokens"]
    dog = result["dog"]
    assert dog["cached"] == [PAGES * BLOCK]  # the first image's pages, loaded for the second
    assert dog["tokens"] == alone["cat"]["tokens"] != alone["dog"]["tokens"]


def test_an_engine_that_names_images_by_request_is_refused_at_start_up(
    mm_engine: Engine, tmp_path: Path
) -> None:
    # vLLM's prefix cache and its processor cache off: vLLM names each image by request
    # (a counter every engine starts again), so kvtier could not tell two images apart
    job = _job(_section(tmp_path / "pages"), [_phase("cat", CAT)])
    job.update(prefix_caching=False, mm_processor_cache_gb=0)
    error = mm_engine.run(job)["startup_error"]
    assert error["type"] == "UnsupportedCombinationError", error
    assert "mm_processor_cache_gb" in error["message"]
    # the same engine settings without kvtier start (the refusal is kvtier's alone)
    plain = _phases(mm_engine.run({**job, "connector": None}))
    assert len(plain["cat"]["tokens"][0]) == 12
