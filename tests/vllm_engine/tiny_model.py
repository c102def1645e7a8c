"""Build the tiny models the vLLM tests and benchmark run: random weights, no download.

``python tests/vllm/tiny_model.py DIR [--kind KIND --layers N --hidden H --heads A
--kv-heads K --intermediate I]``
writes a Hugging Face checkpoint to DIR (seeded, so every run builds the same weights).
``--kind`` is ``llama`` (the default), ``gemma3`` or ``gpt-oss`` (hybrid: sliding-window and
full-attention layers, window 64 tokens), ``deepseek`` (MLA: a DeepSeek-V2-style latent
KV of 512 + 64, the only size vLLM's CPU MLA kernel takes), or a hybrid of attention and
state-space layers, alternating: ``granite4`` (Granite 4.0-H style, Mamba-2 layers, no
experts; vLLM's CPU build runs it only with prefix caching off: its CPU Mamba-2 scan
returns no per-chunk state, which the prefix cache reads) or ``qwen3-next`` (Qwen3-Next
style, gated delta net layers of heads of 128, the size vLLM's CPU kernel takes: 32 is
refused with "Unexpected head dim size").
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

KINDS = ("llama", "gemma3", "gpt-oss", "deepseek", "granite4", "qwen3-next")


def _config(kind: str, spec: dict[str, int]) -> tuple[object, object]:
    """The transformers config and model class of a tiny model of ``kind``."""
    import transformers

    common = {
        "vocab_size": spec["vocab"],
        "hidden_size": spec["hidden"],
        "intermediate_size": spec["intermediate"],
        "num_hidden_layers": spec["layers"],
        "num_attention_heads": spec["heads"],
        "num_key_value_heads": spec["kv_heads"],
        "max_position_embeddings": spec["max_positions"],
    }
    layers = spec["layers"]
    if kind == "gemma3":
        types = ["sliding_attention"] * (layers - 1) + ["full_attention"]
        config = transformers.Gemma3TextConfig(
            **common, head_dim=32, sliding_window=64, layer_types=types
        )
        return config, transformers.Gemma3ForCausalLM
    if kind == "gpt-oss":
        types = ["sliding_attention", "full_attention"] * (layers // 2)
        config = transformers.GptOssConfig(
            **{**common, "intermediate_size": spec["hidden"]},
            head_dim=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=64,
            layer_types=types,
        )
        return config, transformers.GptOssForCausalLM
    if kind == "deepseek":
        config = transformers.DeepseekV2Config(
            **{**common, "num_key_value_heads": spec["heads"]},
            moe_intermediate_size=64,
            kv_lora_rank=512,
            q_lora_rank=None,
            qk_rope_head_dim=64,
            qk_nope_head_dim=32,
            v_head_dim=32,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            topk_method="greedy",
            n_group=1,
            topk_group=1,
        )
        return config, transformers.DeepseekV2ForCausalLM
    if kind == "granite4":
        config = transformers.GraniteMoeHybridConfig(
            **common,
            layer_types=["mamba", "attention"] * (layers // 2),
            num_local_experts=0,
            shared_intermediate_size=spec["intermediate"],
            position_embedding_type="rope",
            mamba_n_heads=2 * spec["hidden"] // 32,
            mamba_d_head=32,
            mamba_n_groups=1,
            mamba_d_state=16,
            mamba_chunk_size=64,
        )
        return config, transformers.GraniteMoeHybridForCausalLM
    if kind == "qwen3-next":
        config = transformers.Qwen3NextConfig(
            **common,
            head_dim=32,
            layer_types=["linear_attention", "full_attention"] * (layers // 2),
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_num_key_heads=1,
            linear_num_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
        )
        return config, transformers.Qwen3NextForCausalLM
    return transformers.LlamaConfig(**common), transformers.LlamaForCausalLM


def build(
    path: str | Path,
    *,
    kind: str = "llama",
    layers: int = 2,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    vocab: int = 512,
    max_positions: int = 4096,
) -> Path:
    """Save a seeded bfloat16 model of ``kind`` to ``path``; return the path."""
    import torch

    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; one of {', '.join(KINDS)}")
    target = Path(path)
    marker = target / "kvtier-tiny-model.json"
    spec: dict[str, object] = {
        "kind": kind,
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
    config, model_class = _config(kind, {k: v for k, v in spec.items() if k != "kind"})  # type: ignore[misc]
    torch.manual_seed(0)
    model = model_class(config).to(torch.bfloat16)  # type: ignore[operator]
    model.save_pretrained(target)
    marker.write_text(json.dumps(spec))
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("path")
    parser.add_argument("--kind", choices=KINDS, default="llama")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=None)
    args = parser.parse_args()
    build(
        args.path,
        kind=args.kind,
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        intermediate=args.intermediate,
    )
    print(args.path)


if __name__ == "__main__":
    main()
