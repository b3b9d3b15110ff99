"""Runs one model step for a scheduled batch: tensors in, the new tokens of each sampled row out.

Two ways to run the model, both over the same paged cache and attention (worker/attention):
- ``native`` (Llama and Qwen2, the default where supported): worker/models/llama.py, fused
  projections and few Python calls per layer; 1.6x transformers' classes at batch 1 on the default
  model.
- ``transformers``: transformers' own model classes (any causal LM it supports) with our paged
  attention registered through its attention interface.
Both give bit-identical numbers to ``generate`` for a lone sequence in float32. Decode steps on the
CPU (bf16, or quantized weights) run the C++ step instead for every family it knows
(worker/models/fused_decode.py): the whole model in one call.

The runner owns the model, the KV cache and the sampler; ``inputs`` turns batches into tensors,
``paths`` runs them (worker/runner/paths.py), and ``execute`` returns one ``RunOutput``.
"""

from __future__ import annotations

import logging

import torch

from common.model_source import ModelSource, load_tokenizer
from common.protocol import NewRequest
from worker.attention import HeadShape, choose_decode_backend
from worker.attention.paged import ATTENTION_NAME
from worker.config import WorkerConfig
from worker.guided import GuidedDecoding
from worker.loader import load_model
from worker.lora import registry as lora_registry
from worker.models import support, vision
from worker.models.family import describe as describe_family
from worker.models.llama import supports as native_supports
from worker.models.shapes import Family
from worker.parallel.group import current as parallel_group
from worker.pooling_spec import PoolingSpec
from worker.request import Request
from worker.runner import kv_cache
from worker.runner.choices import (
    build_fused,
    free_float_weights,
    keep_off_files,
    pick_decode_path,
    pick_device,
    pick_dtype,
    pick_impl,
    rows_only,
    use_graphs,
)
from worker.runner.cuda_graphs import DecodeGraphs
from worker.runner.inputs import InputBuilder
from worker.runner.paths import ExecutionPaths
from worker.runner.pooling_runner import padded, vectors
from worker.runner.probe import learn_layers
from worker.sampler import Sampler, prompt_logprobs
from worker.scheduler import RunOutput, ScheduledBatch
from worker.selfcheck import SelfCheck
from worker.threads import team_size

log = logging.getLogger(__name__)


class ModelRunner:
    """Owns the model, the KV-cache tensors and the sampler."""

    def __init__(self, source: ModelSource, config: WorkerConfig, pooling: PoolingSpec | None = None) -> None:
        """``pooling``: the model also pools its last hidden states (``--pooling`` on a causal LM)."""
        model, text, config = self._load(source, config, pooling)
        # The reference the self-check compares with is computed now: the fused step and the native forward take transformers' layers.
        check = None if config.skip_self_check else SelfCheck(model, self.layers, self.max_model_len, self.block_size)
        if self.group is not None:  # --pipeline-parallel-size: the other stages' layers become relays
            self.group.stage(model)
        fused, only_rows, own = self._pick_forward(source, config, pooling, model, text, check is not None)
        decode_graphs = self._allocate(source, config, model, text, fused, only_rows)
        if check is not None:
            self._self_check(check, own, decode_graphs)

    def _load(self, source: ModelSource, config: WorkerConfig, pooling: PoolingSpec | None) -> tuple:
        """Step 1: the device and dtype, the model loaded (and sharded), refused early when it cannot
        be served, its layers learned. Returns the model, its text config and the device's config."""
        self.threads = team_size(config.threads)
        torch.set_num_threads(self.threads)
        self.device = pick_device(config.device)
        config = config.for_device(self.device.type)  # batch limits left at 0 (the graphs' buckets need them)
        self.dtype = pick_dtype(config.dtype, self.device, quantized_at_rest=source.gguf_file is not None)
        self.block_size = config.block_size
        model = load_model(source, self.dtype, config.cache_dir)
        self.group = parallel_group()  # --tensor-parallel-size > 1: this rank's share of each layer, cut first
        if self.group is not None:
            if pooling is not None:
                raise ValueError("--pooling cannot be used with --tensor-parallel-size > 1: pooling runs whole layers")
            self.group.shard(model)
        text = model.config.get_text_config()
        self.architecture = describe(model)
        support.refuse_by_name(
            model.config.model_type, self.architecture, native_supports(model) and config.model_impl != "transformers"
        )
        if vision.is_image_text(model.config):
            vision.refuse_unserved(model.config, self.architecture)
        self.max_model_len = support.max_model_len(text, config.max_model_len)
        self.model = model.to(self.device).eval()
        self.reference_impl = model.config._attn_implementation  # generate's (sdpa, or eager): pooling forwards run it
        self.pooling_spec = pooling
        self.vision = vision.ImageEncoder(model, self.reference_impl) if vision.is_image_text(model.config) else None
        self.pooling = pooling.info(len(pooling.methods) * text.hidden_size, text) if pooling is not None else None
        try:
            self.layers = learn_layers(model)
        except support.UnsupportedModel as exc:
            raise support.UnsupportedModel(f"{self.architecture} is not supported: {exc}.") from None
        return model, text, config

    def _pick_forward(
        self,
        source: ModelSource,
        config: WorkerConfig,
        pooling: PoolingSpec | None,
        model: torch.nn.Module,
        text: object,
        checked: bool,
    ) -> tuple:
        """Step 2: the decode path (C++ step and its weights, or torch), the forward (native or
        transformers'), the LoRA registry. Returns the fused step, rows-only, and the model's own family."""
        self.quantization, fast_decode = (
            ("none", False)
            if self.group is not None  # the C++ step holds whole layers: split ranks run the torch path
            else pick_decode_path(config.quantization, self.device, self.dtype, model, config.dtype)
        )
        decode_cache = source.cache_dir(config.cache_dir, f"decode-{str(self.dtype).removeprefix('torch.')}")
        fused = build_fused(fast_decode, model, self.quantization, decode_cache)
        by_default = (
            self.device.type == "cpu" and source.gguf_file is not None and config.dtype == "auto" and pooling is None
        )
        if config.quantized_only and self.vision is not None:
            raise ValueError(
                "--quantized-only runs prompts through the C++ step, which takes an image-text model's decode rows only"
            )
        only_rows = rows_only(config.quantized_only, fused, by_default)
        self.rows_by_default = only_rows and config.quantized_only is None
        # The model's own weights, described while its layers are still there (the native forward
        # takes them): where the self-check fails only auto's rounding, the step serves these.
        own = None
        if checked and config.quantization == "auto" and fused is not None and self.quantization != "none":
            own = describe_family(model)
        impl = config.model_impl
        if pooling is not None:  # the native forward takes over the layers that a pooling forward runs (wrong vectors)
            if impl == "native" or only_rows:
                flag = "--model-impl native" if impl == "native" else "--quantized-only"
                raise ValueError(
                    f"--pooling on a generating model runs transformers' classes on its float weights: {flag} cannot be used with it"
                )
            impl = "transformers"
        # auto's rows keep the native forward: runtime LoRA adapters are applied through it
        self.native = None if only_rows and not self.rows_by_default else pick_impl(impl, model)
        why_not = (
            "LoRA adapters are not split across tensor-parallel ranks"
            if self.group is not None
            else None
            if self.native is not None
            else f"LoRA adapters are applied by the native forward, which does not run {self.architecture} here"
        )
        self.loras = lora_registry.build(
            config.lora, why_not, text, config.max_loras, config.max_lora_rank, self.dtype, self.device
        )
        if self.native is not None and self.device.type == "cpu":
            keep_off_files(model)  # what is left of it after the native forward took the layers
        return fused, only_rows, own

    def _allocate(
        self,
        source: ModelSource,
        config: WorkerConfig,
        model: torch.nn.Module,
        text: object,
        fused: object,
        only_rows: bool,
    ) -> DecodeGraphs | None:
        """Step 3: the decode backend, the KV cache, the sampler, the inputs and the execution paths
        (with CUDA graphs where they apply). Returns the decode graphs, if any."""
        # The decode kernels run plain causal layers only (worker/attention/paged.py); a model with
        # none (latent attention: keys wider than values) decodes through the masked gather instead.
        plain = [i for i, layer in enumerate(self.layers) if layer.plain]
        first = self.layers[plain[0] if plain else 0]
        attention = config.cuda_attention
        if not plain and self.device.type == "cuda":
            if attention not in ("auto", "eager"):
                log.warning(
                    "--cuda-attention %s does not apply: no layer is plain causal attention (%s); not applied",
                    attention,
                    first.describe(),
                )
            attention = "eager"
        backend = choose_decode_backend(
            attention,
            self.device,
            self.dtype,
            HeadShape(first.heads, first.kv_heads, first.k_dim, self.block_size),
        )
        graphs = use_graphs(config.cuda_graphs, self.device, self.native, backend)
        self.eos_token_ids = _eos_ids(model)
        self.vocab_size = text.vocab_size
        staged = range(len(self.layers)) if self.group is None or self.group.layers is None else self.group.layers
        shape = kv_cache.CacheShape(  # a pipeline stage caches its own layers (the others': no heads)
            tuple((layer.kv_heads * (i in staged), layer.k_dim, layer.v_dim) for i, layer in enumerate(self.layers)),
            self.block_size,
        )
        agree = None if self.group is None else lambda blocks: self.group.fewest(blocks, self.device)
        self.kv_caches = kv_cache.allocate(
            shape, self.dtype, self.device, config.kv_cache_memory, scratch=graphs, agree=agree
        )
        # With graphs the last block is the padding rows' scratch, outside the block manager's blocks.
        self.num_blocks = self.kv_caches[0][0].shape[0] - graphs
        self.guided = GuidedDecoding(
            lambda: load_tokenizer(source, config.cache_dir), self.vocab_size, self.eos_token_ids
        )
        self.sampler = Sampler(self.device, self.guided)
        backend.prepare([self.kv_caches[i] for i in plain if self.kv_caches[i][0].numel()], first.heads)
        self.inputs = InputBuilder(self.block_size, self.device, self.kv_caches, backend, self.layers)
        decode_graphs = None
        if graphs:
            max_blocks = -(-self.max_model_len // self.block_size)
            decode_graphs = DecodeGraphs(
                self.native, self.kv_caches, first.heads, max_blocks, self.num_blocks, config.max_num_seqs, backend
            )
        self.paths = ExecutionPaths(
            self.model, self.native, fused, self.inputs, decode_graphs, rows_only=only_rows, vision=self.vision
        )
        return decode_graphs

    def _self_check(self, check: SelfCheck, own: Family | None, graphs: DecodeGraphs | None) -> None:
        """The start-up self-check. Where ``--quantization auto`` chose int8 or q4 weights for the C++
        step and only they fail it (a model whose attention is sharp enough that their rounding flips
        its tokens), the step takes the model's own weights instead, and the check runs again."""
        try:
            check.run(self)
        except support.UnsupportedModel as exc:
            if own is None or (self.paths.rows_only and not self.rows_by_default):
                raise
            log.warning(
                "%s weights fail the self-check (%s); the C++ step serves the model's own %s weights instead "
                "(--quantization none; --quantization %s forces it with --skip-self-check)",
                self.quantization,
                str(exc).split(": ", 1)[-1].split(";")[0],
                str(self.dtype).removeprefix("torch."),
                self.quantization,
            )
            self.quantization = "none"
            fused = build_fused(True, self.model, "none", None, own)
            self.paths = ExecutionPaths(self.model, self.native, fused, self.inputs, graphs, vision=self.vision)
            check.run(self)

    def drop_float_weights(self) -> None:
        """With ``--quantized-only``, free the model's float weights once nothing needs them (after
        the self-check and the KV store's weights digest; worker/build.py calls it last)."""
        if self.paths.rows_only and not self.rows_by_default:  # auto's rows keep them for adapters
            free_float_weights(self.model, self.paths.fused)

    @property
    def decode_backend(self) -> str:
        return self.inputs.backend.name

    @property
    def device_type(self) -> str:
        return self.device.type

    def add_request(self, request: Request) -> None:
        """Per-request sampling state; raises GrammarError for a guided request whose grammar is invalid."""
        if request.guide is not None:
            self.guided.add(request)
        if self.vision is not None and request.images:
            request.both_ways = self.vision.both_ways(request)
        self.sampler.add_request(request.request_id, request.sampling.seed)

    def remove_request(self, request: Request) -> None:
        self.sampler.remove_request(request.request_id)

    @torch.inference_mode()
    def pool(self, rows: list[NewRequest]) -> list[bytes]:
        """Pooling rows through the base model's own forward (generate's attention, no KV cache), as the
        pooling runner does; between two of the engine's steps, so the paged attention is put back."""
        assert self.pooling_spec is not None
        inputs = padded(rows, self.device)
        del inputs["token_type_ids"]
        self.model.set_attn_implementation(self.reference_impl)
        try:
            states = self.model.base_model(**inputs, use_cache=False).last_hidden_state
        finally:
            self.model.set_attn_implementation(ATTENTION_NAME)
        return vectors(states, inputs["attention_mask"], rows, self.pooling_spec)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> RunOutput:
        """Run the batch through the model and sample the rows whose prompt is done."""
        paths = self.paths
        if len(batch) == 1 and batch.requests[0].draft_token_ids:
            request = batch.requests[0]
            tokens, logprobs = self.sampler.verify(paths.verify(request), request, request.draft_token_ids)
            return RunOutput({request.request_id: tokens}, {} if logprobs is None else {request.request_id: logprobs})
        # --tensor-parallel-size: the other ranks run the same step on their shards (rank 0 broadcasts it)
        logits, requests = self.logits(batch) if self.group is None else self.group.lead(self.logits, batch)
        return self._sample(logits, requests) if requests else RunOutput()

    def logits(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[Request]]:
        """Logits of the rows the batch samples (row i: the i-th request returned), through the path
        that takes the batch; prompt logprobs are recorded on the way. The self-check reads them too."""
        paths = self.paths
        if paths.takes_graph(batch):
            return paths.graph(batch), batch.requests
        rows = paths.takes_rows(batch)
        inputs = self.inputs.rows(batch) if rows else self.inputs.flat(batch)
        lora = self.loras.segments(inputs.lora_segments) if inputs.lora_segments else None
        logits = paths.rows(inputs, lora) if rows else paths.flat(inputs, lora)
        sampled = len(inputs.sampled_requests)
        self._record_prompt_logprobs(logits[sampled:], inputs.prompt_spans)
        return logits[:sampled], inputs.sampled_requests

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> RunOutput:
        """One token per row (row i is requests[i]), and the logprobs of the rows that asked."""
        tokens, logprobs = self.sampler(logits, requests)
        ids = [r.request_id for r in requests]
        return RunOutput(
            {rid: [token] for rid, token in zip(ids, tokens)},
            {rid: [lp] for rid, lp in zip(ids, logprobs) if lp is not None},
        )

    def _record_prompt_logprobs(self, logits: torch.Tensor, spans: list[tuple[Request, int, int]]) -> None:
        row = 0
        for request, first, count in spans:
            targets = request.token_ids[first + 1 : first + 1 + count]
            request.prompt_logprobs.extend(
                prompt_logprobs(logits[row : row + count], targets, request.sampling.prompt_logprobs or 0)
            )
            row += count


def describe(model: torch.nn.Module) -> str:
    """The architecture as an operator knows it: its class and model type."""
    architectures = getattr(model.config, "architectures", None) or [type(model).__name__]
    return f"{architectures[0]} (model type {model.config.model_type!r})"


def _eos_ids(model: object) -> frozenset[int]:
    """End-of-sequence ids from the generation config, falling back to the model config."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            ids.update(eos if isinstance(eos, list) else [eos])
    return frozenset(ids)
