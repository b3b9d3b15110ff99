"""Worker settings: each is a flag with an environment twin (see common.config)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from common.config import CACHE_DIR, MODEL, MODEL_FLAGS, SHARED_FLAGS, Flag, SharedConfig

# A worker's exit code when its model or flags can never work (sysexits' EX_CONFIG): the launcher
# does not restart it (worker/models/support.py refuses models; refused flags raise ValueError).
EXIT_UNSUPPORTED = 78

WORKER_FLAGS = [
    Flag(
        "gateway-address",
        "tcp://127.0.0.1:5555",
        "ZeroMQ address(es) of the gateways' ROUTER sockets, comma-separated (tcp:// or ipc://); a name resolving to several addresses is several gateways",
    ),
    Flag("worker-name", None, "Name this worker registers under (default: host-pid)"),
    Flag("device", "auto", "auto (CUDA when present, else CPU), cpu, cuda or cuda:N"),
    Flag(
        "dtype",
        "auto",
        "auto (bfloat16 on GPUs and on CPUs that compute it natively, AVX512-BF16 or AMX: 2x fp32's speed there; "
        "elsewhere float32 with int8/q4 weights in the C++ step), bfloat16, float16, float32 (an explicit bf16/fp16 "
        "a CPU does not compute is refused)",
    ),
    Flag(
        "kv-cache-memory",
        "auto",
        "KV cache size: bytes (e.g. 2GiB), a fraction of free GPU memory (e.g. 0.85), or auto (1GiB on CPU, 0.85 on GPU)",
    ),
    Flag("block-size", 16, "Tokens per KV-cache block", int),
    Flag("max-num-seqs", 0, "Most sequences in one step (the batch size limit); 0: 128 on the CPU, 256 on a GPU", int),
    Flag(
        "max-num-batched-tokens",
        0,
        "Token budget of one step; longer prompts are prefilled in chunks; 0: 512 on the CPU, 8192 on a GPU",
        int,
    ),
    Flag(
        "max-prefill-chunk",
        0,
        "Most prompt tokens in one step while other requests are decoding (keeps their inter-token latency steady); 0: 64 on the CPU, 2048 on a GPU",
        int,
    ),
    Flag(
        "max-encoder-images-per-step",
        0,
        "Image-text models: most images the vision encoder runs on in one step while other requests are decoding (a prompt "
        "chunk ends before an image over it, so a request with many images does not stall their streams); 0: 1 on the CPU, 8 on a GPU",
        int,
    ),
    Flag(
        "mm-processor-kwargs",
        None,
        "Image-text models: a JSON object of options for the model's image processor (vLLM's --mm-processor-kwargs), "
        "e.g. '{\"do_pan_and_scan\": true}' for Gemma 3; the gateways run the processor with them",
    ),
    Flag(
        "prefix-caching",
        True,
        "Reuse the KV blocks of prompt prefixes seen before (a shared system prompt, earlier turns)",
        bool,
    ),
    Flag(
        "kv-events-endpoint",
        None,
        "Publish KV-cache events (vLLM's BlockStored / BlockRemoved / AllBlocksCleared, msgpack) on a ZeroMQ PUB socket: "
        "tcp://*:PORT binds, tcp://HOST:PORT connects to a subscriber that bound (worker/kv_events.py); off when not given",
    ),
    Flag(
        "kv-events-replay-endpoint",
        None,
        "With --kv-events-endpoint: a ZeroMQ ROUTER address (bound, e.g. tcp://*:5558) where a subscriber that joined late "
        "or missed batches asks for them again from a sequence number (vLLM's replay; the last 10,000 batches); off when not given",
    ),
    Flag(
        "kv-store",
        None,
        "A second tier for prefix-cache blocks that outlives the worker and is shared by the pool: a folder (workers of this "
        "machine, or of many on a shared filesystem) or redis://HOST:PORT/DB (workers anywhere); off when not given (worker/kv_store)",
    ),
    Flag(
        "kv-store-size",
        "10GiB",
        "Most bytes a --kv-store folder may hold; beyond, the least recently used blocks go (Redis: its own maxmemory)",
    ),
    Flag("max-model-len", 0, "Longest sequence (prompt + output) accepted; 0 means the model's own limit", int),
    Flag(
        "skip-self-check",
        False,
        "Start even if the start-up self-check fails (the serving path's logits against transformers' own forward on two fixed prompts); "
        "a failing worker would serve wrong text",
        bool,
    ),
    Flag(
        "model-impl",
        "auto",
        "native (fused Llama-family forward), transformers (any causal LM), or auto (native where supported)",
    ),
    Flag("drain-timeout", 30.0, "Seconds a draining worker (after SIGTERM) may spend finishing its requests", float),
    Flag("curve-client-secret-key", None, "CURVE: this worker's secret key file (from `llmpool keys`)"),
    Flag("curve-server-public-key", None, "CURVE: the gateway's public key file"),
    Flag(
        "threads",
        0,
        "CPU threads a step uses; 0: the CPUs this process may use (affinity mask, cgroup CPU quota), shared by serve's local workers",
        int,
    ),
    Flag(
        "adaptive-threads",
        True,
        "Run steps on fewer threads while other processes take cores (worker/threads.py), and on all again when they are free",
        bool,
    ),
    Flag(
        "quantization",
        "auto",
        "Weights of the C++ decode kernel: int8 (weight-only, a scale per output row), q4 (4 bits, a scale and minimum per 32 inputs), none (the model's dtype), "
        "or auto (on the CPU unless an explicit --dtype float32: q4 for a model that came as 4-bit weights, like the default Q4_1 GGUF; else int8)",
    ),
    Flag(
        "quantized-only",
        None,
        "Keep only the C++ step's quantized weights (int8/q4, packed): prompts run through that step too, and the model's "
        "float copy is freed after the start-up self-check; refused where the step cannot take every batch. Unset (auto): "
        "prompts through the step, float copy kept (runtime LoRA adapters use it), for a GGUF on the CPU with --dtype auto "
        "where the step takes every batch, as llama.cpp runs it (its answers are then the same on every instruction set: "
        "worker/cpu.py); --no-quantized-only keeps prompts on the torch path",
        bool,
    ),
    Flag(
        "cuda-graphs",
        "auto",
        "CUDA graphs for decode steps, one per batch-size bucket (worker/runner/cuda_graphs.py): on, off, or auto (on for a CUDA worker in bfloat16 or "
        "float16 with FlashInfer or the Triton attention kernel; float32 keeps the eager path, token-identical to generate)",
    ),
    Flag(
        "cuda-attention",
        "auto",
        "Decode attention on CUDA: flashinfer (FlashInfer's paged decode, worker/attention/flashinfer_decode.py; pip install '.[flashinfer]'), "
        "triton (worker/attention/triton_decode.py: reads the paged cache in place, split over the context), eager (a batched matmul over the "
        "gathered context), or auto (except in float32, which stays eager: flashinfer where it is installed and passes its check at "
        "start, else triton)",
    ),
    Flag(
        "pooling",
        "auto",
        "Serve the model as an embedder: auto (a sentence-transformers folder's own modules.json and 1_Pooling config; a cross-encoder "
        "by its classifier head; an encoder such as BERT: cls; a causal LM: generation), none (generate), or cls, mean, max, last, "
        "mean_sqrt_len (this pooling of the last hidden states; last for a decoder embedder such as Qwen3-Embedding; a causal LM "
        "then generates too, chat and embedding rows sharing its steps)",
    ),
    Flag(
        "pooling-share",
        0.5,
        "In a worker that both generates and embeds (a causal LM with --pooling), the most of its step time that pooling rows "
        "take while chat requests run too (its chat streams then keep at least the rest); 1: a pooling row in every step",
        float,
    ),
    Flag(
        "pooling-normalize",
        True,
        "L2-normalize the vectors of a model pooled by --pooling (a sentence-transformers folder says for itself)",
        bool,
    ),
    Flag(
        "lora",
        None,
        "A LoRA adapter to serve beside the model, as NAME=PATH (a peft adapter folder; repeat the flag, or separate with commas); "
        "a request picks it with `model: NAME`. Needs the native forward (Llama and Qwen2 families); more at runtime with POST /v1/load_lora_adapter",
        repeat=True,
    ),
    Flag(
        "max-loras",
        4,
        "Most LoRA adapters resident at once (and running in one step); the others are read from disk when needed, least recently used out first",
        int,
    ),
    Flag("max-lora-rank", 16, "Largest LoRA rank accepted; an adapter of a higher rank is refused", int),
    Flag(
        "speculate",
        0,
        "Speculative decoding: up to N draft tokens per step for a lone request, looked up in its own prompt and output (n-grams), "
        "verified in one step; 0 turns it off",
        int,
    ),
    Flag(
        "tensor-parallel-size",
        1,
        "Ranks that split each layer (heads, MLP columns) of one model, joined with torch.distributed (gloo on the CPU, NCCL on GPUs): "
        "the worker is rank 0, owns the gateway socket and starts the others (worker/parallel); --kv-cache-memory is per rank",
        int,
    ),
    Flag(
        "pipeline-parallel-size",
        1,
        "Stages that split the decoder layers of one model (vLLM's flag): stage s is ranks s*T..s*T+T-1 of a world of "
        "tensor x pipeline ranks, each caching only its layers (docs/parallel.md)",
        int,
    ),
    Flag("nnodes", 1, "Machines one worker's ranks span (vLLM's --nnodes); each runs world size / nnodes ranks", int),
    Flag("node-rank", 0, "This machine's place among --nnodes (0 holds rank 0 and the gateway socket)", int),
    Flag(
        "master-addr",
        "127.0.0.1",
        "Address of rank 0's torch.distributed rendezvous (vLLM's --master-addr; torchrun's MASTER_ADDR wins when set)",
    ),
    Flag(
        "master-port",
        0,
        "Port of that rendezvous; 0: a free one (one machine only; torchrun's MASTER_PORT wins when set)",
        int,
    ),
    Flag(
        "headless",
        False,
        "Run only this machine's ranks, with no gateway socket (vLLM's --headless, for --node-rank > 0)",
        bool,
    ),
    Flag(
        "dist-timeout",
        60.0,
        "Seconds a rank waits in one step's collective before it gives up and the whole group exits (a dead or hung rank)",
        float,
    ),
]


@dataclass(slots=True)
class WorkerConfig(SharedConfig):
    """Parsed worker settings."""

    model: str = MODEL.default
    served_model_name: str | None = None
    cache_dir: str = CACHE_DIR.default
    chat_template: str | None = None
    gateway_address: str = "tcp://127.0.0.1:5555"
    worker_name: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    kv_cache_memory: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 0  # 0: DEVICE_DEFAULTS for the device the worker runs on (for_device)
    max_num_batched_tokens: int = 0
    max_prefill_chunk: int = 0
    max_encoder_images_per_step: int = 0
    mm_processor_kwargs: str | None = None  # JSON, read by bundle_tokenizer
    prefix_caching: bool = True
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_store: str | None = None
    kv_store_size: str = "10GiB"
    max_model_len: int = 0
    model_impl: str = "auto"
    skip_self_check: bool = False
    quantization: str = "auto"
    quantized_only: bool | None = None  # None: auto (see the flag)
    cuda_graphs: str = "auto"
    cuda_attention: str = "auto"
    threads: int = 0
    adaptive_threads: bool = True
    speculate: int = 0
    lora: list[str] | None = None
    max_loras: int = 4
    max_lora_rank: int = 16
    pooling: str = "auto"
    pooling_share: float = 0.5
    pooling_normalize: bool = True
    drain_timeout: float = 30.0
    curve_client_secret_key: str | None = None
    curve_server_public_key: str | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    headless: bool = False
    dist_timeout: float = 60.0

    def for_device(self, device_type: str) -> WorkerConfig:
        """These settings with the batch limits left at 0 filled in for ``device_type`` ("cpu", "cuda")."""
        defaults = DEVICE_DEFAULTS["cpu" if device_type == "cpu" else "cuda"]
        return replace(self, **{name: getattr(self, name) or value for name, value in defaults.items()})


# Batch limits by device. On 2 CPU cores a step of 16 decodes takes 9-16 ms and a 64-token prompt
# chunk beside them keeps their inter-token latency steady; a GPU runs a 256-row decode step in
# 8-12 ms and prefills thousands of tokens in one (measured on an H100, README "On a GPU"), as
# vLLM's defaults assume (256 sequences, an 8,192-token budget).
DEVICE_DEFAULTS = {
    "cpu": {
        "max_num_seqs": 128,
        "max_num_batched_tokens": 512,
        "max_prefill_chunk": 64,
        "max_encoder_images_per_step": 1,
    },
    "cuda": {
        "max_num_seqs": 256,
        "max_num_batched_tokens": 8192,
        "max_prefill_chunk": 2048,
        "max_encoder_images_per_step": 8,
    },
}

ALL_WORKER_FLAGS = [*SHARED_FLAGS, *MODEL_FLAGS, *WORKER_FLAGS]
