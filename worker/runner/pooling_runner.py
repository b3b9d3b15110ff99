"""The runner of a pooling model: embedders (BERT, XLM-RoBERTa, ModernBERT, a causal LM's last
hidden states) and cross-encoders, through transformers' own classes.

Why no paged KV cache: a pooling request is one forward pass whose keys and values are never read
again, and an encoder's attention is bidirectional, so the paged cache (written token by token,
read causally) would only cost memory and a copy. Each step's pooling rows run as one padded batch
through the model's own forward, with the attention mask; nothing outlives the step, and the prefix
cache is never touched. A batch is padded to its longest row: the engine bounds a step's rows by
``--max-num-batched-tokens``, and rows of similar length are the common case (a client's batch of
chunks).
"""

from __future__ import annotations

import inspect
import logging

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification
from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

from common.model_source import ModelSource
from common.pooling import PoolingInfo, PoolingTask
from common.protocol import NewRequest
from worker.config import WorkerConfig
from worker.models import support
from worker.pooling_spec import PoolingSpec
from worker.request import Request
from worker.runner.choices import pick_device, pick_dtype
from worker.scheduler import RunOutput, ScheduledBatch
from worker.threads import team_size

log = logging.getLogger(__name__)

# RoBERTa-style position ids start after the padding index: two of max_position_embeddings are never used.
_OFFSET_POSITIONS = ("roberta", "xlm-roberta", "camembert", "xlm-roberta-xl")


class PoolingRunner:
    """Loads the model and turns a step's pooling rows into vectors; it generates nothing."""

    num_blocks = 0  # no KV cache: the engine's block manager stays empty
    eos_token_ids: frozenset[int] = frozenset()

    def __init__(self, source: ModelSource, config: WorkerConfig, spec: PoolingSpec) -> None:
        self.threads = team_size(config.threads)
        torch.set_num_threads(self.threads)
        self.device = pick_device(config.device)
        self.dtype = pick_dtype(config.dtype, self.device)
        self.quantization = "none"
        self.spec = spec
        hf = AutoConfig.from_pretrained(spec.weights)
        self.architecture = (getattr(hf, "architectures", None) or [type(hf).__name__])[0]
        cls = AutoModelForSequenceClassification if spec.task == PoolingTask.SCORE else AutoModel
        self.model = cls.from_pretrained(spec.weights, dtype=self.dtype).to(self.device).eval()
        self.causal = not is_encoder_type(hf.model_type)
        text = hf.get_text_config()
        self.vocab_size = text.vocab_size
        self.max_model_len = self._limit(text, config.max_model_len)
        self.takes_token_types = "token_type_ids" in inspect.signature(self.model.forward).parameters
        size = 1 if spec.task == PoolingTask.SCORE else len(spec.methods) * text.hidden_size
        self.pooling: PoolingInfo = spec.info(size, hf)
        log.info("pooling model %s: %s, %s", source.name, self.architecture, self.pooling)

    def _limit(self, text: object, requested: int) -> int:
        limit = support.max_model_len(text, requested)
        if getattr(text, "model_type", "") in _OFFSET_POSITIONS:
            limit = min(limit, getattr(text, "max_position_embeddings", limit) - getattr(text, "pad_token_id", 1) - 1)
        return min(limit, self.spec.max_seq_length or limit)

    @property
    def device_type(self) -> str:
        return self.device.type

    def add_request(self, request: Request) -> None:  # the engine sends generation requests elsewhere
        raise ValueError("a pooling model generates nothing")

    def remove_request(self, request: Request) -> None:
        pass

    def execute(self, batch: ScheduledBatch) -> RunOutput:
        raise RuntimeError("a pooling model runs no generation step")

    @torch.inference_mode()
    def pool(self, rows: list[NewRequest]) -> list[bytes]:
        """Each row's vector (or a cross-encoder's one score) as float32 little-endian bytes."""
        if self.spec.task == PoolingTask.SCORE and self.causal and len(rows) > 1:
            return [
                v for row in rows for v in self.pool([row])
            ]  # a causal classifier finds its last token by the pad id
        inputs = padded(rows, self.device)
        types = inputs.pop("token_type_ids")
        if self.takes_token_types:
            inputs["token_type_ids"] = types
        out = self.model(**inputs)
        if self.spec.task == PoolingTask.SCORE:
            logits = out.logits[:, 0].float()
            scores = (torch.sigmoid(logits) if self.spec.activation == "sigmoid" else logits)[:, None]
            return [score.numpy().astype("<f4").tobytes() for score in scores.cpu()]
        return vectors(out.last_hidden_state, inputs["attention_mask"], rows, self.spec)


def padded(rows: list[NewRequest], device: torch.device) -> dict[str, torch.Tensor]:
    """The rows as one right-padded batch: ids, attention mask, token types (a pair's segments)."""
    width = max(len(r.prompt_token_ids) for r in rows)
    ids, mask, types = (torch.zeros((len(rows), width), dtype=torch.long) for _ in range(3))
    for i, row in enumerate(rows):
        n = len(row.prompt_token_ids)
        ids[i, :n] = torch.tensor(row.prompt_token_ids)
        mask[i, :n] = 1
        if row.pooling is not None and row.pooling.token_type_ids:
            types[i, :n] = torch.tensor(row.pooling.token_type_ids[:n])
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "token_type_ids": types.to(device)}


def vectors(states: torch.Tensor, mask: torch.Tensor, rows: list[NewRequest], spec: PoolingSpec) -> list[bytes]:
    """Each row's vector from its token states, pooled as ``spec`` says; Matryoshka truncation first,
    then normalization (vLLM's and OpenAI's order); float32 little-endian bytes."""
    pooled_rows = torch.cat([pooled(states.float(), mask, m) for m in spec.methods], dim=-1).cpu()
    out = []
    for vector, row in zip(pooled_rows, rows):
        if row.pooling is not None and row.pooling.dimensions is not None:
            vector = vector[: row.pooling.dimensions]
        if spec.normalize:
            vector = F.normalize(vector, p=2, dim=-1)
        out.append(vector.contiguous().numpy().astype("<f4").tobytes())
    return out


def is_encoder_type(model_type: str) -> bool:
    """Whether a model type attends both ways (BERT, XLM-RoBERTa, ModernBERT...): a masked-LM family."""
    return model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES


def pooled(states: torch.Tensor, mask: torch.Tensor, method: str) -> torch.Tensor:
    """One vector per row from its token states ``[rows, tokens, hidden]`` (padding masked out), as
    sentence-transformers' Pooling computes it."""
    if method == "cls":
        return states[:, 0]
    if method == "last":
        last = mask.sum(dim=1) - 1
        return states[torch.arange(states.shape[0], device=states.device), last]
    weights = mask.unsqueeze(-1).to(states.dtype)
    if method == "max":
        return states.masked_fill(weights == 0, torch.finfo(states.dtype).min).max(dim=1).values
    total, count = (states * weights).sum(dim=1), weights.sum(dim=1).clamp(min=1e-9)
    return total / (count.sqrt() if method == "mean_sqrt_len" else count)
