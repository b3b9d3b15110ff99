"""The ways one step runs the model, each returning the logits of the rows that are sampled.

- ``graph``: decode rows only, on CUDA: replay the captured graph of the batch's bucket
  (worker/runner/cuda_graphs.py).
- ``rows``: the C++ step (worker/models/fused_decode.py): the whole model in one call, every
  scheduled token a row. Decode rows (any number with packed weights, else up to
  FAST_DECODE_MAX_ROWS), and with packed weights also prompt chunks beside them, whose tokens see
  each other causally because the kernel writes all rows' keys and values of a layer before that
  layer's attention. With 16 streams decoding (9-11 ms a step) and a 2,000-token prompt arriving,
  the steps that carry its chunks take 44-48 ms (median) and 62-67 ms (p99) this way; 64 ms and
  74-88 ms with the chunks in the torch path beside the C++ decode rows. A LoRA adapter's rows
  (worker/lora) get its low-rank products inside the step, so adapters' decodes stay on it. An
  image-text model's batches of generated tokens alone take it (text, plain embeddings; M-RoPE's
  position past the images); its prompt chunks, which carry image features, run on the torch path,
  and so do the decode rows beside them.
- ``flat``: the torch path (the native forward or transformers' classes) over one flat sequence;
  prefill-only batches (oneDNN's bf16 GEMMs and SDPA do large chunks faster) and prompts that want
  logprobs take it (adding adapters' products too), except with ``--quantized-only``, where every
  batch is rows.
- ``verify``: a lone request's drafts (worker/speculative.py), as rows on the C++ path, else as a
  prompt chunk.
"""

from __future__ import annotations

import torch

from worker.attention.paged import step_metadata
from worker.lora.adapter import Segments
from worker.models.fused_decode import FusedDecode
from worker.models.llama import LlamaForward
from worker.models.vision import ImageEncoder
from worker.request import Request
from worker.runner.cuda_graphs import DecodeGraphs
from worker.runner.inputs import FlatInputs, InputBuilder, RowInputs, is_decode_row
from worker.scheduler import ScheduledBatch

# Most decode rows for the C++ decode step with its matrix-vector loops (bf16 or q4 weights, or int8
# without VNNI); beyond this oneDNN's bf16 matmuls beat them (engine CPU time per step on one thread:
# 8 rows 25.8 vs 32.1 ms, 12 rows 34.7 vs 32.6). Packed int8 (the default) has no limit: its GEMM
# kernel beat the torch path at every size measured (decode step, 2 threads: 16 rows 15.7 vs 26.7 ms,
# 64 rows 51.5 vs 75.4, 128 rows 110 vs 137).
FAST_DECODE_MAX_ROWS = 8


class ExecutionPaths:
    def __init__(
        self,
        model: torch.nn.Module,
        native: LlamaForward | None,
        fused: FusedDecode | None,
        inputs: InputBuilder,
        graphs: DecodeGraphs | None,
        rows_only: bool = False,
        vision: ImageEncoder | None = None,
    ) -> None:
        self.model = model
        self.native = native
        self.fused = fused  # the C++ step, where it runs this model
        self.fast = fused is not None
        self.inputs = inputs
        self.graphs = graphs
        self.rows_only = rows_only  # --quantized-only: the model's float weights are gone; every batch is rows
        self.vision = vision  # an image-text model's encoder: chunks with image tokens run on embeddings

    def takes_graph(self, batch: ScheduledBatch) -> bool:
        return (
            self.graphs is not None
            and not any(r.lora for r in batch.requests)  # adapters' rows: the torch path adds their products
            and len(batch) <= self.graphs.max_rows
            and all(map(is_decode_row, batch.requests, batch.num_new_tokens))
        )

    def graph(self, batch: ScheduledBatch) -> torch.Tensor:
        requests, slot = batch.requests, self.inputs.slot
        positions = [r.num_computed_tokens for r in requests]
        return self.graphs.run(
            [r.token_ids[p] for r, p in zip(requests, positions)],
            positions,
            [slot(r.block_ids, p) for r, p in zip(requests, positions)],
            [r.block_ids for r in requests],
            [p + 1 for p in positions],
        )

    def takes_rows(self, batch: ScheduledBatch) -> bool:
        """Whether the C++ step takes the batch (see the module docstring)."""
        if self.rows_only:
            return True
        if not self.fast or (any(r.lora for r in batch.requests) and not self.fused.takes_lora):
            return False
        decodes = sum(map(is_decode_row, batch.requests, batch.num_new_tokens))
        if self.vision is not None:  # generated tokens only: a prompt's last token may be an image's
            return (
                decodes == len(batch.requests)
                and all(r.num_computed_tokens >= r.num_prompt_tokens for r in batch.requests)
                and (self.fused.any_batch or decodes <= FAST_DECODE_MAX_ROWS)
            )
        if decodes == len(batch.requests):
            return self.fused.any_batch or decodes <= FAST_DECODE_MAX_ROWS
        return (
            self.fused.any_batch
            and decodes > 0
            and not any(r.draft_token_ids or r.sampling.prompt_logprobs is not None for r in batch.requests)
        )

    def rows(self, rows: RowInputs, lora: Segments | None = None) -> torch.Tensor:
        positions = rows.positions
        if self.vision is not None and self.vision.mrope:  # each row a generated token (``takes_rows``)
            # M-RoPE's position past an image prompt (its three axes equal: plain RoPE at that position)
            spans = [(r, i, r.num_computed_tokens, 1) for i, r in enumerate(rows.sampled_requests) if r.images]
            positions = self.vision.positions(positions.unsqueeze(0), spans)[0, 0] if spans else positions
        return self.fused(
            rows.ids,
            positions,
            self.inputs.kv_caches,
            rows.slots,
            rows.tables,
            rows.lengths,
            keep=rows.keep,
            lora=lora,
        )

    def flat(self, inputs: FlatInputs, lora: Segments | None = None) -> torch.Tensor:
        if self.native is not None:
            return self.native(inputs.input_ids, inputs.positions, inputs.metadata, inputs.logits_indices, lora)
        ids: dict[str, torch.Tensor] = {"input_ids": inputs.input_ids}
        positions = inputs.positions
        if self.vision is not None and inputs.image_rows:
            ids = {"inputs_embeds": self.vision.embeds(inputs.input_ids, inputs.image_rows)}
        if self.vision is not None and self.vision.mrope:
            positions = self.vision.positions(positions, inputs.rope_rows)
        with step_metadata(inputs.metadata):  # for the layers that do not pass kwargs on to attention
            return self.model(
                **ids,
                position_ids=positions,
                logits_to_keep=inputs.logits_indices,
                use_cache=False,
            ).logits[0]

    def verify(self, request: Request) -> torch.Tensor:
        """Logits of the last token and of each draft after it."""
        mrope = self.vision is not None and self.vision.mrope  # its positions: the torch path's ``flat``
        if self.rows_only or (self.fast and not mrope and 1 + len(request.draft_token_ids) <= FAST_DECODE_MAX_ROWS):
            return self.rows(self.inputs.verify_rows(request))
        return self.flat(self.inputs.verify_flat(request))
