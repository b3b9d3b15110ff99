"""Tiny random pooling models (tests/worker/families.py's sizes: hidden 64, 2 layers; seeded), saved
the way a worker loads them: a sentence-transformers folder written by hand (``modules.json``,
``1_Pooling/config.json``, a ``Normalize`` module where asked), a cross-encoder, or a bare encoder
for ``--pooling``.

Every model shares one WordPiece tokenizer of 105 entries (special tokens, letters, short words);
it appends ``[SEP]``, so a decoder's last-token pooling reads an end marker, as Qwen3-Embedding's
tokenizer appends ``<|endoftext|>``.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import torch
from transformers import AutoModel, AutoModelForSequenceClassification, BertTokenizerFast

from tests.worker.families import family_config

WORDS = "the a of to and in is was for on that with as it by be at from this are or an not have which one cat dog sat mat paris france capital river".split()
PST = "sentence_transformers.models."
# name -> (model type, pooling modes of 1_Pooling/config.json, Normalize, config extras)
EMBEDDERS = {
    "bert-mean": ("bert", ["mean_tokens"], True, {}),
    "xlm-roberta-cls": ("xlm-roberta", ["cls_token"], False, dict(pad_token_id=1, max_position_embeddings=514)),
    "modernbert-mean": (
        "modernbert",
        ["mean_tokens"],
        True,
        dict(
            global_attn_every_n_layers=2,
            local_attention=16,
            bos_token_id=2,
            eos_token_id=3,
            cls_token_id=2,
            sep_token_id=3,
        ),
    ),
    "qwen3-last": ("qwen3", ["lasttoken"], True, dict(matryoshka_dimensions=[32, 16])),
}


def tokenizer(folder: Path) -> BertTokenizerFast:
    folder.mkdir(parents=True, exist_ok=True)
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    pieces = list(string.ascii_lowercase) + [f"##{c}" for c in string.ascii_lowercase] + list(string.digits + ".,?!'")
    vocab = (special + pieces + WORDS)[:256]
    tok = BertTokenizerFast(vocab={token: i for i, token in enumerate(vocab)}, do_lower_case=True)
    tok.save_pretrained(folder)
    return tok


def embedder(name: str, folder: Path, seed: int = 0, sentence_transformers: bool = True) -> Path:
    """A random ``EMBEDDERS[name]`` saved in ``folder``, as a sentence-transformers folder unless told not."""
    model_type, modes, normalize, extra = EMBEDDERS[name]
    torch.manual_seed(seed)
    model = AutoModel.from_config(family_config(model_type, extra)).eval()
    _randomize_norms(model)
    model.save_pretrained(folder)
    tokenizer(folder)
    if sentence_transformers:
        modules = [
            {"idx": 0, "name": "0", "path": "", "type": PST + "Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": PST + "Pooling"},
        ]
        if normalize:
            modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": PST + "Normalize"})
            (folder / "2_Normalize").mkdir(exist_ok=True)
        (folder / "modules.json").write_text(json.dumps(modules))
        (folder / "1_Pooling").mkdir(exist_ok=True)
        pooling = {
            "word_embedding_dimension": 64,
            **{f"pooling_mode_{m}": m in modes for m in ("cls_token", "mean_tokens", "max_tokens", "lasttoken")},
        }
        (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
        (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256, "do_lower_case": False}))
    return folder


def cross_encoder(folder: Path, seed: int = 0) -> Path:
    """A BERT cross-encoder (one relevance logit) as sentence-transformers' CrossEncoder saves one."""
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(family_config("bert", {"num_labels": 1})).eval()
    _randomize_norms(model)
    with torch.no_grad():  # a spread of scores (the default init gives them all within 1e-4), so rankings are clear
        model.classifier.weight.normal_(0, 2.0)
    model.config.sentence_transformers = {"activation_fn": "torch.nn.modules.activation.Sigmoid"}
    model.save_pretrained(folder)
    tokenizer(folder)
    return folder


def _randomize_norms(model: torch.nn.Module) -> None:
    """Norm weights and biases drawn at random (transformers starts them at 1 and 0, which would hide a dropped one)."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name.lower() or name.endswith("bias"):
                parameter.add_(torch.randn_like(parameter) * 0.1)
