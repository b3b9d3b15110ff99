"""``python -m bench.random_llama DIR [--size 1b|smol]``: a Llama with random weights, built from a
config, with the default model's tokenizer and chat template: a model to serve and test on a machine
that reaches no model hub (the GPU runs in bench/gpu.sh, tests/gpu).

- ``1b``: Llama-3.2-1B's shape (hidden 2048, 16 layers, 32 query / 8 KV heads of 64, MLP 8192, tied
  embeddings) over SmolLM2's 49,152-token vocabulary: 1.07 B parameters, 2.1 GB in bf16.
- ``smol``: the default model's exact shape (576 hidden, 30 layers, 9 / 3 heads): same speed as the
  real weights, for speed runs where the GGUF file is not at hand.
- ``smol-even``: that shape with 8 / 4 heads of 64 (queries 512 wide), which two tensor-parallel
  ranks can split (bench/parallel.py); 9 / 3 heads split only by 3.

Random weights give near-uniform next-token distributions, so they prove speed and exactness
(float32 output against ``generate``), not text quality.
"""

from __future__ import annotations

import argparse
from pathlib import Path

SHAPES = {
    "1b": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
    },
    "smol": {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
    },
    "smol-even": {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
    },
}


def load_default_tokenizer(tokenizer_dir: str | None):  # a transformers tokenizer
    """The default model's tokenizer: from ``tokenizer_dir`` (saved with ``save_pretrained``) or the GGUF package."""
    from transformers import AutoTokenizer

    if tokenizer_dir:
        return AutoTokenizer.from_pretrained(tokenizer_dir)
    from common.config import CACHE_DIR
    from common.model_source import DEFAULT_MODEL, load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(DEFAULT_MODEL), CACHE_DIR.env_default())


def build(folder: Path, size: str = "1b", tokenizer_dir: str | None = None, seed: int = 0) -> Path:
    """Write config, bf16 safetensors and tokenizer to ``folder`` (skipped when a model is already there)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    if (folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file():
        return folder
    tokenizer = load_default_tokenizer(tokenizer_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=8192,
        rope_parameters={"rope_theta": 100000.0, "rope_type": "default"},
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
        **({"head_dim": 64} | SHAPES[size]),
    )
    torch.manual_seed(seed)
    with torch.device(
        "cuda" if torch.cuda.is_available() else "cpu"
    ):  # initialising 1 B weights takes a minute on a CPU
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--size", choices=sorted(SHAPES), default="1b")
    parser.add_argument(
        "--tokenizer", help="a folder with the default model's tokenizer (default: from the GGUF package)"
    )
    args = parser.parse_args()
    print(build(args.folder, args.size, args.tokenizer))


if __name__ == "__main__":
    main()
