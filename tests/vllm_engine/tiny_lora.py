"""Build a random LoRA adapter (PEFT format) for the tiny Llama of ``tiny_model.py``.

``python tests/vllm_engine/tiny_lora.py MODEL_DIR ADAPTER_DIR SEED`` writes
``adapter_config.json`` and ``adapter_model.safetensors`` with rank-8 A and B matrices on
every layer's ``q_proj``, ``k_proj`` and ``v_proj``, seeded, large enough that greedy
tokens under two adapters and the base model differ.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RANK = 8
TARGETS = ("q_proj", "k_proj", "v_proj")


def build(model: str | Path, target: str | Path, seed: int) -> Path:
    """Write the adapter for the model at ``model`` into ``target``; return it."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((Path(model) / "config.json").read_text())
    hidden = int(config["hidden_size"])
    head_dim = hidden // int(config["num_attention_heads"])
    outputs = {
        "q_proj": hidden,
        "k_proj": int(config["num_key_value_heads"]) * head_dim,
        "v_proj": int(config["num_key_value_heads"]) * head_dim,
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(int(config["num_hidden_layers"])):
        for name in TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(RANK, hidden, generator=generator)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(
                outputs[name], RANK, generator=generator
            )
    directory = Path(target)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "r": RANK,
                "lora_alpha": 2 * RANK,
                "lora_dropout": 0.0,
                "bias": "none",
                "target_modules": list(TARGETS),
                "base_model_name_or_path": str(model),
            }
        )
    )
    return directory


if __name__ == "__main__":
    print(build(sys.argv[1], sys.argv[2], int(sys.argv[3])))
