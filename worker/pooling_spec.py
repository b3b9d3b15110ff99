"""How a model pools, read from its folder and the flags: a sentence-transformers folder's own
config (``modules.json``, ``1_Pooling/config.json``, a ``Normalize`` module) where it has one, a
cross-encoder's classifier head, else ``--pooling``.

A model whose configuration asks for something this worker would compute differently (a ``Dense``
module, weighted-mean pooling, a classifier with several labels) is refused at start, by name,
rather than served with vectors sentence-transformers would not give.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from common.pooling import PoolingInfo, PoolingTask
from worker.models.support import UnsupportedModel

# sentence-transformers' Pooling flags, in the order it concatenates the vectors they give.
ST_MODES = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "last",
}
METHODS = ("cls", "mean", "max", "last", "mean_sqrt_len")
POOLING_CHOICES = ("auto", "none", *METHODS)
ACTIVATIONS = {"torch.nn.modules.activation.Sigmoid": "sigmoid", "torch.nn.modules.linear.Identity": "identity"}


@dataclass(slots=True)
class PoolingSpec:
    """What the pooling runner does: load ``weights`` (a folder) and pool its token states."""

    task: str  # PoolingTask.EMBED or PoolingTask.SCORE
    weights: str
    methods: list[str] = field(default_factory=list)  # concatenated in this order (embed)
    normalize: bool = False
    activation: str = "sigmoid"  # of a cross-encoder's one logit (score)
    max_seq_length: int | None = None  # sentence-transformers' own bound on the tokens it reads
    generates: bool = False  # a causal LM pooled by --pooling: it generates too, and both share its steps

    def info(self, dimensions: int, config: object) -> PoolingInfo:
        tasks = [PoolingTask.EMBED, PoolingTask.SCORE] if self.task == PoolingTask.EMBED else [PoolingTask.SCORE]
        tasks = [PoolingTask.GENERATE, *tasks] if self.generates else tasks
        sizes = getattr(config, "matryoshka_dimensions", None) or []
        matryoshka = bool(getattr(config, "is_matryoshka", False) or sizes)
        return PoolingInfo(tasks, "+".join(self.methods), self.normalize, dimensions, matryoshka, list(sizes))


def pooling_spec(
    path: str, architectures: list[str], encoder: bool, pooling: str, normalize: bool, causal: bool = False
) -> PoolingSpec | None:
    """How the model in ``path`` pools; None for a model that only generates. ``pooling`` is the flag:
    ``auto`` (the folder says; an encoder with no word pools its first token, as vLLM's BERT does),
    ``none`` (generate), or a method. A method on a ``causal`` LM (a GGUF file, a ...ForCausalLM
    folder without a sentence-transformers config) keeps it generating and pools its last hidden
    states too, in the same steps; on any other model it makes an embedder."""
    if pooling not in POOLING_CHOICES:
        raise ValueError(f"--pooling must be one of {', '.join(POOLING_CHOICES)}; got {pooling!r}")
    folder = Path(path)
    if pooling == "none" or not folder.is_dir():
        if pooling not in ("auto", "none"):
            raise ValueError(
                f"--pooling {pooling} needs a model folder (config.json and weights) or a GGUF file; got {path}"
            )
        return None
    if any(a.endswith("ForSequenceClassification") for a in architectures):
        return _cross_encoder(folder)
    if (folder / "modules.json").is_file():
        return _sentence_transformers(folder, pooling, normalize)
    if pooling == "auto":
        return PoolingSpec(PoolingTask.EMBED, path, ["cls"], normalize) if encoder else None
    return PoolingSpec(PoolingTask.EMBED, path, [pooling], normalize, generates=causal)


def _sentence_transformers(folder: Path, pooling: str, normalize: bool) -> PoolingSpec:
    spec = PoolingSpec(PoolingTask.EMBED, str(folder))
    for module in json.loads((folder / "modules.json").read_text()):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        where = folder / module.get("path", "")
        if kind == "Transformer":
            spec.weights = str(where)
            bert = where / "sentence_bert_config.json"
            spec.max_seq_length = json.loads(bert.read_text()).get("max_seq_length") if bert.is_file() else None
        elif kind == "Pooling":
            config = json.loads((where / "config.json").read_text())
            spec.methods = [name for key, name in ST_MODES.items() if config.get(key)]
        elif kind == "Normalize":
            spec.normalize = True
        else:
            raise UnsupportedModel(
                f"the sentence-transformers module {module.get('type')!r} ({module.get('path')}) is not supported"
            )
    if pooling != "auto":  # the flag wins over the folder, as vLLM's --pooler-config does
        spec.methods, spec.normalize = [pooling], normalize
    unsupported = [m for m in spec.methods if m not in METHODS]
    if unsupported or not spec.methods:
        raise UnsupportedModel(
            f"pooling {'+'.join(unsupported) or 'none'} is not supported (supported: {', '.join(METHODS)})"
        )
    return spec


def _cross_encoder(folder: Path) -> PoolingSpec:
    config = json.loads((folder / "config.json").read_text())
    labels = len(config.get("id2label") or {}) or config.get("num_labels", 1)
    if labels != 1:
        raise UnsupportedModel(
            f"a sequence classifier with {labels} labels is not a reranker (one relevance logit); it is not supported"
        )
    named = (config.get("sentence_transformers") or {}).get("activation_fn", "torch.nn.modules.activation.Sigmoid")
    if named not in ACTIVATIONS:
        raise UnsupportedModel(
            f"the cross-encoder's activation {named!r} is not supported (supported: {', '.join(ACTIVATIONS)})"
        )
    return PoolingSpec(PoolingTask.SCORE, str(folder), activation=ACTIVATIONS[named])
