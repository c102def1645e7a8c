"""Build a tiny multimodal model vLLM's CPU build serves: random weights, no download.

``python tests/vllm_engine/tiny_mm_model.py DIR`` writes an Idefics3 checkpoint (a
2-layer vision encoder on 112x112 images, a pixel-shuffle connector, a 2-layer Llama)
with its processor: a word-level tokenizer built here (``w44`` .. ``w511`` are the words,
one token each, so a test writes its prompt's token ids as text) and Idefics3's image
processor without image splitting. One image becomes 19 prompt tokens: 16 image tokens
between ``<fake_token_around_image><global-img>`` and ``<fake_token_around_image>``.

Why Idefics3: vLLM 0.32's CPU environment has no torchvision (its PyPI wheels are CUDA
builds; ``scripts/install-vllm.sh`` removes them), and vLLM's LLaVA, PaliGemma, Qwen2-VL,
Qwen2.5-VL, Gemma 3 and LLaVA-Next code import torchvision, directly or through
``vllm/model_executor/models/vision.py``'s ``get_vision_encoder_info``, which imports
transformers' Pixtral image processor. Idefics3 needs neither: transformers falls back
to its PIL image processor.

:func:`image` makes the seeded test images the engine runner puts in a prompt.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

#: The tokenizer's special tokens, ids 0.. in this order; words take the ids after them.
SPECIALS = (
    "<unk>",
    "<s>",
    "</s>",
    "<pad>",
    "<fake_token_around_image>",
    "<image>",
    "<end_of_utterance>",
    "<global-img>",
    *(f"<row_{row}_col_{col}>" for row in range(1, 7) for col in range(1, 7)),
)
VOCAB = 512
FIRST_WORD = len(SPECIALS)  # w44
IMAGE_SIZE = 112
#: Prompt tokens one image takes (the 16 image tokens and the three around them).
IMAGE_TOKENS = 19


def image(seed: int, size: int = IMAGE_SIZE) -> Any:
    """A seeded RGB noise image (PIL) of ``size`` x ``size``: one seed, one image."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def text(token_ids: list[int]) -> str:
    """The prompt text whose tokens are ``token_ids`` (each in ``FIRST_WORD .. VOCAB-1``)."""
    if any(not FIRST_WORD <= t < VOCAB for t in token_ids):
        raise ValueError(f"word token ids are {FIRST_WORD}..{VOCAB - 1}")
    return " ".join(f"w{t}" for t in token_ids)


def _processor() -> Any:
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(SPECIALS)}
    vocab.update({f"w{i}": i for i in range(FIRST_WORD, VOCAB)})
    words = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=words,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIALS[4:])})
    # without torchvision, transformers gives its PIL image processor
    images = transformers.Idefics3ImageProcessor(
        do_image_splitting=False,
        size={"longest_edge": IMAGE_SIZE},
        max_image_size={"longest_edge": IMAGE_SIZE},
    )
    return transformers.Idefics3Processor(
        image_processor=images, tokenizer=tokenizer, image_seq_len=IMAGE_TOKENS - 3
    )


def build(path: str | Path) -> Path:
    """Save the seeded bfloat16 model and its processor to ``path``; return the path."""
    import torch
    import transformers

    target = Path(path)
    marker = target / "kvtier-tiny-mm-model.json"
    spec = {"kind": "idefics3", "vocab": VOCAB, "image_size": IMAGE_SIZE}
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return target
    processor = _processor()
    vision = transformers.Idefics3VisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=IMAGE_SIZE,
        patch_size=14,
    )
    llama = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        pad_token_id=SPECIALS.index("<pad>"),
    )
    config = transformers.Idefics3Config(
        vision_config=vision,
        text_config=llama,
        image_token_id=processor.image_token_id,
        scale_factor=2,  # (112 / 14)^2 = 64 patches, shuffled into 16 image tokens
        pad_token_id=SPECIALS.index("<pad>"),
    )
    torch.manual_seed(0)
    model = transformers.Idefics3ForConditionalGeneration(config).to(torch.bfloat16)
    model.save_pretrained(target)
    processor.save_pretrained(target)
    marker.write_text(json.dumps(spec))
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("path")
    print(build(parser.parse_args().path))


if __name__ == "__main__":
    main()
