"""Runs one model step for a scheduled batch: tensors in, one sampled token per finished prompt out.

Two ways to run the model, both over the same paged cache and attention:
- ``native`` (Llama-family models, the default where supported): worker/llama.py, fused projections
  and few Python calls per layer; 1.6x transformers' classes at batch 1 on the default model.
- ``transformers``: transformers' own model classes (any causal LM it supports) with our paged
  attention registered through its attention interface.
Both give bit-identical numbers to ``generate`` for a lone sequence.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from common.config import parse_size
from common.model_source import ModelSource, load_tokenizer
from common.protocol import TokenLogprobs
from worker import flashinfer_attention, kernels, triton_attention
from worker.attention import ATTENTION_NAME, CUDA_KERNELS, AttentionMetadata, DecodeGroup, PrefillSpan
from worker.config import WorkerConfig
from worker.cuda_graphs import DecodeGraphs
from worker.guided import GuidedDecoding
from worker.llama import LlamaForward, supports
from worker.loader import load_model
from worker.quantization import CHOICES as QUANTIZATION_CHOICES
from worker.quantization import on_4bit_grid
from worker.request import Request
from worker.sampler import Sampler, prompt_logprobs
from worker.scheduler import ScheduledBatch

log = logging.getLogger(__name__)

MIN_GROUP = 8  # fewest decode rows worth a separate attention call
# Most decode rows for the C++ decode step with its matrix-vector loops (bf16 or q4 weights, or int8
# without VNNI); beyond this oneDNN's bf16 matmuls beat them (engine CPU time per step on one thread:
# 8 rows 25.8 vs 32.1 ms, 12 rows 34.7 vs 32.6). Packed int8 (the default) has no limit: its GEMM
# kernel beat the torch path at every size measured (decode step, 2 threads: 16 rows 15.7 vs 26.7 ms,
# 64 rows 51.5 vs 75.4, 128 rows 110 vs 137).
FAST_DECODE_MAX_ROWS = 8
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_CPU_DEFAULT_KV_BYTES = 2**30
ATTENTION_CHOICES = ("auto", "flashinfer", "triton", "eager")
# A step's new tokens of each request that produced any, and the logprobs of those that asked (one per token).
Sampled = tuple[dict[str, list[int]], dict[str, list[TokenLogprobs]]]


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pick_dtype(name: str) -> torch.dtype:
    """bfloat16 by default: on this project's CPUs (AVX-512 bf16) it decodes about 2x faster than fp32."""
    if name == "auto":
        return torch.bfloat16
    if name not in _DTYPES:
        raise ValueError(f"--dtype must be one of auto, {', '.join(_DTYPES)}; got {name!r}")
    return _DTYPES[name]


@dataclass(slots=True)
class StepInputs:
    """The flat batch of one step."""

    input_ids: torch.Tensor  # [1, num_tokens]
    positions: torch.Tensor  # [1, num_tokens]
    logits_indices: torch.Tensor  # rows whose last token is sampled, then rows for prompt logprobs
    sampled_requests: list[Request]
    prompt_spans: list[tuple[Request, int, int]]  # (request, first prompt position, count) needing prompt logprobs
    metadata: AttentionMetadata


class ModelRunner:
    """Owns the model, the KV-cache tensors and the sampler."""

    def __init__(self, source: ModelSource, config: WorkerConfig) -> None:
        if config.threads > 0:
            torch.set_num_threads(config.threads)
        self.device = pick_device(config.device)
        self.dtype = pick_dtype(config.dtype)
        self.block_size = config.block_size
        model = load_model(source, self.dtype, config.cache_dir)
        model.set_attn_implementation(ATTENTION_NAME)
        self.model = model.to(self.device).eval()
        self.quantization, self.fast_decode = self._pick_decode_path(config.quantization)
        self.native = self._pick_impl(config.model_impl, source.cache_dir(config.cache_dir, f"decode-{str(self.dtype).removeprefix('torch.')}"))
        model_config = model.config.get_text_config()
        self.decode_backend = self._pick_attention(config.cuda_attention, model_config)
        use_graphs = self._use_graphs(config.cuda_graphs)
        limit = model_config.max_position_embeddings
        self.max_model_len = min(limit, config.max_model_len) if config.max_model_len > 0 else limit
        self.eos_token_ids = _eos_ids(model)
        self.vocab_size = model_config.vocab_size
        self.kv_caches = self._allocate_kv_cache(model_config, config.kv_cache_memory, scratch=use_graphs)
        # With graphs the last block is the padding rows' scratch, outside the block manager's blocks.
        self.num_blocks = self.kv_caches[0][0].shape[0] - use_graphs
        self.guided = GuidedDecoding(lambda: load_tokenizer(source, config.cache_dir), self.vocab_size, self.eos_token_ids)
        self.sampler = Sampler(self.device, self.guided)
        heads = model_config.num_attention_heads
        if self.decode_backend == "triton":  # compile its kernels now, not in the middle of a step
            triton_attention.warm_up(*self.kv_caches[0], heads=heads)
        self.flashinfer = None  # the "flashinfer" backend: the schedule of eager steps' decode rows
        workspace = None
        if self.decode_backend == "flashinfer":
            workspace = flashinfer_attention.make_workspace(self.device)
            self.flashinfer = flashinfer_attention.FlashInferDecode(self.kv_caches[0][0], heads, workspace)
        self.graphs = None
        if use_graphs:
            max_blocks = -(-self.max_model_len // self.block_size)
            self.graphs = DecodeGraphs(self.native, self.kv_caches, heads, max_blocks, self.num_blocks, config.max_num_seqs, workspace)

    def _pick_impl(self, choice: str, cache: Path | None) -> LlamaForward | None:
        if choice not in ("auto", "native", "transformers"):
            raise ValueError(f"--model-impl must be auto, native or transformers; got {choice!r}")
        native_ok = supports(self.model)
        if choice == "native" and not native_ok:
            raise ValueError(f"--model-impl native does not support model type {self.model.config.model_type!r}")
        use_native = native_ok and choice != "transformers"
        log.info("model implementation: %s", "native (worker/llama.py)" if use_native else "transformers classes")
        if not use_native:
            return None
        return LlamaForward(self.model, fast_decode=self.fast_decode, quantization=self.quantization, cache=cache)

    def _pick_attention(self, choice: str, model_config: object) -> str:
        """The decode rows' attention (worker/attention.py): the C++ kernel on the CPU; on CUDA what
        ``choice`` names, or for auto the first that runs of FlashInfer, the Triton kernel and the
        eager gather. float32 keeps the eager path under auto, so that output equals ``generate``."""
        if choice not in ATTENTION_CHOICES:
            raise ValueError(f"--cuda-attention must be one of {', '.join(ATTENTION_CHOICES)}; got {choice!r}")
        if self.device.type == "cpu":
            return "cpu" if kernels.load() else "eager"
        if choice == "auto":
            choice = self._auto_attention(model_config)
        elif choice == "flashinfer":
            if not self._flashinfer_usable():
                raise ValueError(
                    "--cuda-attention flashinfer needs the flashinfer-python package, triton, a CUDA device and --dtype float16 or bfloat16"
                )
            problem = self._check_flashinfer(model_config)
            if problem is not None:
                raise ValueError(f"--cuda-attention flashinfer: FlashInfer failed its check: {problem}")
        elif choice == "triton" and not triton_attention.available():
            raise ValueError("--cuda-attention triton needs the triton package and a CUDA device")
        log.info("decode attention on %s: %s", self.device, choice)
        return choice

    def _auto_attention(self, model_config: object) -> str:
        if self.dtype == torch.float32:
            return "eager"
        if self._flashinfer_usable():
            problem = self._check_flashinfer(model_config)
            if problem is None:
                return "flashinfer"
            log.warning("FlashInfer is installed but failed its check (%s): decode attention falls back to the Triton kernel", problem)
        return "triton" if triton_attention.available() else "eager"

    def _flashinfer_usable(self) -> bool:
        """Installed, on a GPU, in one of its dtypes, and with triton beside it (decode steps run rotary
        and the cache writes in a Triton kernel, worker/triton_rope.py)."""
        return flashinfer_attention.available() and triton_attention.available() and self.dtype in flashinfer_attention.DTYPES

    def _check_flashinfer(self, model_config: object) -> str | None:
        """FlashInfer against the eager gather on this model's head shapes (compiling its kernels)."""
        page = (self.block_size, model_config.num_key_value_heads, _head_dim(model_config))
        return flashinfer_attention.check(model_config.num_attention_heads, page, self.dtype, self.device)

    def _use_graphs(self, choice: str) -> bool:
        """CUDA graphs need the native forward and an attention kernel whose launches a graph can hold
        (Triton's launch shape is static; FlashInfer's is, with a schedule per batch-size bucket)."""
        if choice not in ("auto", "on", "off"):
            raise ValueError(f"--cuda-graphs must be auto, on or off; got {choice!r}")
        possible = self.device.type == "cuda" and self.native is not None and self.decode_backend in CUDA_KERNELS
        if choice == "on" and not possible:
            raise ValueError(
                "--cuda-graphs on needs a CUDA device, a Llama-family model (--model-impl native) and --cuda-attention flashinfer or triton"
            )
        return possible and choice != "off"

    def _pick_decode_path(self, choice: str) -> tuple[str, bool]:
        """(weights, whether the C++ decode step runs): it runs on the CPU in bf16/fp16, or in any
        dtype once weights are quantized; float32 without quantization keeps the exact torch path
        (token-identical to ``generate``)."""
        if choice not in QUANTIZATION_CHOICES:
            raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATION_CHOICES)}; got {choice!r}")
        usable = self.device.type == "cpu" and kernels.load()
        if choice == "auto":
            choice = "none" if not usable or self.dtype == torch.float32 else "int8"
            if choice == "int8" and kernels.has_vnni() and on_4bit_grid(self.model):
                choice = "q4"  # the model came as 4-bit weights: q4 keeps them as they are, at 0.6x int8's bytes
        if choice != "none" and not usable:
            raise ValueError(f"--quantization {choice} needs the C++ CPU kernels: {kernels.unavailable_reason() or 'not on the CPU'}")
        fast = usable and (choice != "none" or self.dtype != torch.float32)
        log.info("small-batch decode: %s, weights %s", "C++ kernel" if fast else "torch", choice)
        return choice, fast

    def _allocate_kv_cache(self, model_config: object, budget: str, scratch: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer a K and a V tensor of ``[num_blocks, block_size, kv_heads, head_dim]``, plus one
        block with ``scratch`` (where CUDA graphs' padding rows write)."""
        layers = model_config.num_hidden_layers
        kv_heads = model_config.num_key_value_heads
        head_dim = _head_dim(model_config)
        bytes_per_block = 2 * layers * self.block_size * kv_heads * head_dim * self.dtype.itemsize
        num_bytes = self._kv_budget_bytes(budget)
        num_blocks = num_bytes // bytes_per_block
        if num_blocks < 1:
            raise ValueError(f"--kv-cache-memory {budget} is less than one block ({bytes_per_block} bytes)")
        log.info("KV cache: %d blocks of %d tokens (%.2f GiB)", num_blocks, self.block_size, num_blocks * bytes_per_block / 2**30)
        shape = (num_blocks + scratch, self.block_size, kv_heads, head_dim)
        return [
            (torch.zeros(shape, dtype=self.dtype, device=self.device), torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(layers)
        ]

    def _kv_budget_bytes(self, budget: str) -> int:
        on_gpu = self.device.type == "cuda"
        if budget == "auto":
            budget = "0.85" if on_gpu else str(_CPU_DEFAULT_KV_BYTES)
        if "." in budget and float(budget) <= 1.0:
            if not on_gpu:
                raise ValueError("a fractional --kv-cache-memory needs a GPU; give bytes on the CPU (e.g. 2GiB)")
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * float(budget))
        return parse_size(budget)

    def add_request(self, request: Request) -> None:
        """Per-request sampling state; raises GrammarError for a guided request whose grammar is invalid."""
        if request.guide is not None:
            self.guided.add(request)
        self.sampler.add_request(request.request_id, request.sampling.seed)

    def remove_request(self, request: Request) -> None:
        self.sampler.remove_request(request.request_id)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> Sampled:
        """Run the batch through the model; return the new tokens of each request whose prompt is
        done (one, or with drafts to verify the accepted ones plus one), and the logprobs of those
        that asked for them."""
        if len(batch) == 1 and batch.requests[0].draft_token_ids:
            return self._execute_verify(batch.requests[0])
        if self.graphs is not None and len(batch) <= self.graphs.max_rows and all(map(_is_decode_row, batch.requests, batch.num_new_tokens)):
            return self._execute_graph(batch)
        if self._fits_rows(batch):
            return self._execute_rows(batch)
        return self._execute_torch(batch)

    def _execute_torch(self, batch: ScheduledBatch) -> Sampled:
        inputs = self._prepare(batch)
        logits = self._forward(inputs.input_ids, inputs.positions, inputs.metadata, inputs.logits_indices)
        self._record_prompt_logprobs(logits[len(inputs.sampled_requests) :], inputs.prompt_spans)
        if not inputs.sampled_requests:
            return {}, {}
        return self._sample(logits[: len(inputs.sampled_requests)], inputs.sampled_requests)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            return self.native(input_ids, positions, metadata, logits_indices)
        return self.model(
            input_ids=input_ids,
            position_ids=positions,
            logits_to_keep=logits_indices,
            use_cache=False,
            paged_metadata=metadata,
        ).logits[0]

    def _execute_verify(self, request: Request) -> Sampled:
        """The last token and the drafts after it, as query positions of one sequence (worker/speculative.py).

        On the C++ path they run as decode rows that share the request's block table, each with its
        own context length: the kernel writes every row's keys and values of a layer before that
        layer's attention, so row i sees the drafts before it. Elsewhere they run as a prompt chunk
        (causal over the cached context).
        """
        start = request.num_computed_tokens
        ids = [request.token_ids[start], *request.draft_token_ids]
        n = len(ids)
        bs = self.block_size
        positions = self._tensor(list(range(start, start + n)))
        slots = self._tensor([request.block_ids[p // bs] * bs + p % bs for p in range(start, start + n)])
        if self.fast_decode and self.native is not None and n <= FAST_DECODE_MAX_ROWS:
            tables = self._tensor([request.block_ids] * n)
            logits = self.native.decode(self._tensor(ids), positions, self.kv_caches, slots, tables, positions + 1, start + n)
        else:
            metadata = AttentionMetadata(self.kv_caches, slots, 0, [], [self._prefill_span(request, 0, n)], self.decode_backend)
            logits = self._forward(self._tensor(ids).unsqueeze(0), positions.unsqueeze(0), metadata, torch.arange(n, device=self.device))
        tokens, logprobs = self.sampler.verify(logits, request, request.draft_token_ids)
        return {request.request_id: tokens}, ({} if logprobs is None else {request.request_id: logprobs})

    def _fits_rows(self, batch: ScheduledBatch) -> bool:
        """Whether the C++ step takes the batch: single-token decode rows (any number with packed
        weights, else up to FAST_DECODE_MAX_ROWS), or, with packed weights, decode rows mixed with
        the prompt chunks the scheduler caps while others decode (``max_prefill_chunk``). Batches
        without a decode row (prefill: oneDNN's bf16 GEMMs and SDPA do large chunks faster) and
        prompts that want logprobs keep the torch path."""
        if not (self.fast_decode and self.native is not None):
            return False
        decodes = sum(map(_is_decode_row, batch.requests, batch.num_new_tokens))
        if decodes == len(batch.requests):
            return self.native.decode_any_batch or decodes <= FAST_DECODE_MAX_ROWS
        return (
            self.native.decode_any_batch
            and decodes > 0
            and not any(r.draft_token_ids or r.sampling.prompt_logprobs is not None for r in batch.requests)
        )

    def _execute_rows(self, batch: ScheduledBatch) -> Sampled:
        """One C++ call for the whole model, every scheduled token a row: a decode row, or one
        token of a prompt chunk that shares its request's block table with a context length of its
        own (the kernel writes all rows' keys and values of a layer before that layer's attention,
        so a chunk's tokens see each other causally, as speculative drafts do). Logits only for
        the rows that are sampled: decode rows, and the last token of a prompt this step completes.

        With 16 streams decoding (9-11 ms a step) and a 2,000-token prompt arriving, the steps that
        carry its chunks take 44-48 ms (median) and 62-67 ms (p99) this way; 64 ms and 74-88 ms
        with the chunks in the torch path beside the C++ decode rows."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        tables: list[list[int]] = []
        keep: list[int] = []
        sampled: list[Request] = []
        for request, n in zip(batch.requests, batch.num_new_tokens):
            start = request.num_computed_tokens
            ids.extend(request.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            tables.extend([request.block_ids] * n)
            if start + n == request.num_tokens:
                keep.append(len(ids) - 1)
                sampled.append(request)
        width = max(len(t) for t in tables)
        logits = self.native.decode(
            self._tensor(ids),
            self._tensor(positions),
            self.kv_caches,
            self._tensor([t[p // bs] * bs + p % bs for t, p in zip(tables, positions)]),
            self._tensor([t + [0] * (width - len(t)) for t in tables]),
            self._tensor([p + 1 for p in positions]),
            max(positions) + 1,
            keep=None if len(keep) == len(ids) else self._tensor(keep),
        )
        return self._sample(logits, sampled) if sampled else ({}, {})

    def _execute_graph(self, batch: ScheduledBatch) -> Sampled:
        """Decode rows only: replay the CUDA graph of the batch's bucket (worker/cuda_graphs.py)."""
        bs = self.block_size
        requests = batch.requests
        positions = [r.num_computed_tokens for r in requests]
        logits = self.graphs.run(
            [r.token_ids[p] for r, p in zip(requests, positions)],
            positions,
            [r.block_ids[p // bs] * bs + p % bs for r, p in zip(requests, positions)],
            [r.block_ids for r in requests],
            [p + 1 for p in positions],
        )
        return self._sample(logits, requests)

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> Sampled:
        """One token per row (row i is requests[i]), and the logprobs of the rows that asked."""
        tokens, logprobs = self.sampler(logits, requests)
        ids = [r.request_id for r in requests]
        return {rid: [token] for rid, token in zip(ids, tokens)}, {rid: [lp] for rid, lp in zip(ids, logprobs) if lp is not None}

    def _record_prompt_logprobs(self, logits: torch.Tensor, spans: list[tuple[Request, int, int]]) -> None:
        row = 0
        for request, first, count in spans:
            targets = request.token_ids[first + 1 : first + 1 + count]
            request.prompt_logprobs.extend(prompt_logprobs(logits[row : row + count], targets, request.sampling.prompt_logprobs or 0))
            row += count

    def _prepare(self, batch: ScheduledBatch) -> StepInputs:
        """Flatten the batch: single-token rows first (batched attention), then prompt chunks."""
        # Single-token rows first, shortest context first (so groups of similar length pad little).
        rows = sorted(zip(batch.requests, batch.num_new_tokens), key=lambda row: (row[1] > 1, row[0].num_computed_tokens))
        num_decode = sum(1 for _, n in rows if n == 1)
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_indices: list[int] = []
        sampled: list[Request] = []
        prompt_rows: list[int] = []
        prompt_spans: list[tuple[Request, int, int]] = []
        prefills: list[PrefillSpan] = []
        bs = self.block_size
        for request, n in rows:
            start = request.num_computed_tokens
            first = len(input_ids)
            input_ids.extend(request.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            slots.extend(request.block_ids[p // bs] * bs + p % bs for p in range(start, start + n))
            if start + n == request.num_tokens:
                logits_indices.append(first + n - 1)
                sampled.append(request)
            if request.sampling.prompt_logprobs is not None:  # positions whose next prompt token needs a logprob
                low, high = max(start, len(request.prompt_logprobs)), min(start + n, request.num_prompt_tokens - 1)
                if low < high:
                    prompt_rows.extend(range(first + low - start, first + high - start))
                    prompt_spans.append((request, low, high - low))
            if n > 1:
                prefills.append(self._prefill_span(request, first, n))
        decode_rows = [request for request, _ in rows[:num_decode]]
        metadata = AttentionMetadata(
            kv_caches=self.kv_caches,
            slot_mapping=self._tensor(slots),
            num_decode=num_decode,
            decode_groups=self._decode_groups(decode_rows),
            prefills=prefills,
            decode_backend=self.decode_backend,
        )
        return StepInputs(
            input_ids=self._tensor(input_ids).unsqueeze(0),
            positions=self._tensor(positions).unsqueeze(0),
            logits_indices=self._tensor(logits_indices + prompt_rows),
            sampled_requests=sampled,
            prompt_spans=prompt_spans,
            metadata=metadata,
        )

    def _decode_groups(self, rows: list[Request]) -> list[DecodeGroup]:
        """Single-token rows in groups: one for the C++ or Triton kernel, which read each row's own length.

        The eager fallback pads every row to its group's longest context (at batch 64, 40% slower
        than equal lengths), so there a new group starts when the next row (sorted by length) is
        more than a quarter longer than the group's first, and groups have at least MIN_GROUP rows.
        """
        if rows and self.decode_backend != "eager":  # one group: also FlashInfer's, which has one schedule a step
            return [self._decode_group(rows, 0)]
        groups = []
        start = 0
        for end in range(1, len(rows) + 1):
            last = end == len(rows)
            if last or (end - start >= MIN_GROUP and rows[end].num_computed_tokens > 1.25 * (rows[start].num_computed_tokens + 1)):
                groups.append(self._decode_group(rows[start:end], start))
                start = end
        return groups

    def _decode_group(self, rows: list[Request], start: int) -> DecodeGroup:
        lengths = [r.num_computed_tokens + 1 for r in rows]
        max_blocks = max(len(r.block_ids) for r in rows)
        tables = self._tensor([r.block_ids + [0] * (max_blocks - len(r.block_ids)) for r in rows])
        group = DecodeGroup(start, len(rows), tables, self._tensor(lengths), max(lengths))
        if self.flashinfer is not None:  # its schedule is made on the host, once for all layers
            self.flashinfer.plan([r.block_ids for r in rows], lengths)
            group.planned = self.flashinfer
        return group

    def _prefill_span(self, request: Request, first: int, n: int) -> PrefillSpan:
        computed = request.num_computed_tokens
        mask = None
        if computed > 0:  # a later chunk: attend to the cached prefix plus a causal block
            keys = torch.arange(computed + n, device=self.device)
            queries = torch.arange(computed, computed + n, device=self.device)
            mask = (keys.unsqueeze(0) <= queries.unsqueeze(1))[None, None]
        return PrefillSpan(first, n, computed, self._tensor(request.block_ids), mask)

    def _tensor(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)


def _is_decode_row(request: Request, num_new_tokens: int) -> bool:
    """One new token after a fully computed context, and no drafts to verify: a plain decode row."""
    return num_new_tokens == 1 and request.num_computed_tokens + 1 == request.num_tokens and not request.draft_token_ids


def _head_dim(model_config: object) -> int:
    return getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads


def _eos_ids(model: object) -> frozenset[int]:
    """End-of-sequence ids from the generation config, falling back to the model config."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            ids.update(eos if isinstance(eos, list) else [eos])
    return frozenset(ids)
