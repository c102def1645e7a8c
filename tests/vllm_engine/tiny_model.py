"""Build the tiny Llama the vLLM tests and benchmark run: random weights, no download.

``python tests/vllm/tiny_model.py DIR [--layers N --hidden H --heads A --kv-heads K
--intermediate I]``
writes a Hugging Face checkpoint to DIR (seeded, so every run builds the same weights).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def build(
    path: str | Path,
    *,
    layers: int = 2,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    vocab: int = 512,
    max_positions: int = 4096,
) -> Path:
    """Save a seeded bfloat16 ``LlamaForCausalLM`` to ``path``; return the path."""
    import torch
    import transformers

    target = Path(path)
    marker = target / "kvtier-tiny-model.json"
    spec = {
        "layers": layers,
        "hidden": hidden,
        "heads": heads,
        "kv_heads": kv_heads,
        "intermediate": intermediate or 2 * hidden,
        "vocab": vocab,
        "max_positions": max_positions,
    }
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return target
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=spec["intermediate"],
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(target)
    marker.write_text(json.dumps(spec))
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("path")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=None)
    args = parser.parse_args()
    build(
        args.path,
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        intermediate=args.intermediate,
    )
    print(args.path)


if __name__ == "__main__":
    main()
