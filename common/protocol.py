"""The wire contract between the gateway (ROUTER) and the workers (DEALER).

Every message is two ZeroMQ frames: a two-byte header ``[PROTOCOL_VERSION, MsgType]`` and a msgpack payload holding one
of the Structs below in array form: the values in field order, without their names (a step's one-token output takes 55
bytes where the named form took 232). The full request travels once (``AddRequests``); then only deltas (``StepOutputs``:
each request's new token ids). Nothing is ever pickled. Array form makes field order part of the contract: add fields at
the end of a message, with a default (a shorter array decodes, its missing trailing fields taking their defaults), and
bump PROTOCOL_VERSION for anything else. A peer of another version is refused at the handshake (``refusal``), in words
that version can read. (``omit_defaults`` omits nothing in array form as of msgspec 0.22, jcrist/msgspec#720.)
"""

from __future__ import annotations

from enum import IntEnum
from typing import Union

import msgspec

from common.images import ImageInput
from common.lora import LoraCommand, LoraInfo, LoraLoad, LoraResult
from common.pooling import PoolingInfo, PoolingParams

PROTOCOL_VERSION = 3  # 1: the same messages as named maps (dataclasses); 2: single-token thinking markers
BATCH_PRIORITY = 2**31  # the batch runner's requests: less urgent than any priority a client may ask for


class Wire(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Base of every message and of the records inside them: arrays on the wire, defaults omitted;
    never in a reference cycle, so the garbage collector need not track them."""


class MsgType(IntEnum):
    """One-byte message type carried in the header frame."""

    READY = 1
    HEARTBEAT = 2
    ADD_REQUESTS = 3
    ABORT = 4
    STEP_OUTPUTS = 5
    ERROR = 6
    GOODBYE = 7
    DESCRIBE_MODEL = 8
    MODEL_INFO = 9
    LORA_COMMAND = 10
    LORA_RESULT = 11


class FinishReason:
    """Why a request stopped; the strings are OpenAI's ``finish_reason`` where one exists."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class SamplingParams(Wire):
    """Per-request sampling; ``temperature == 0`` means greedy, ``top_k == 0`` means off. Penalties, bias
    and ``min_tokens`` change the logits before the choice, greedy or not (OpenAI's and vLLM's semantics)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = {}
    min_tokens: int = 0
    logprobs: int | None = None  # None: none; k >= 0: the chosen token's logprob and the k most likely
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (echo + logprobs)


class GuideKind:
    """The grammars a worker can constrain sampling to."""

    JSON_SCHEMA = "json_schema"  # spec: a JSON Schema document (as JSON text)
    JSON_OBJECT = "json_object"  # any JSON object; spec unused
    REGEX = "regex"  # spec: a regular expression the whole output matches (a choice is an escaped alternation)
    GRAMMAR = "grammar"  # spec: a Lark grammar (llguidance's dialect), or GBNF as llguidance reads it


class Guide(Wire):
    """Guided decoding: every sampled token must keep the output inside this grammar."""

    kind: str
    spec: str = ""


class Reasoning(Wire):
    """A reasoning model's thinking section, as the worker enforces it (common/reasoning.py): the
    markers' token ids (one token or several: ``<thinking>`` is three in a vocabulary without it),
    where the prompt left the thinking (``ThinkState``), and how many thinking tokens may come
    before the worker forces the end marker (None: no bound but ``max_new_tokens``)."""

    start_token_ids: list[int]
    end_token_ids: list[int]
    state: int = 0
    budget: int | None = None


class NewRequest(Wire):
    """A request as the worker needs it: token ids in, budget and stop rules."""

    request_id: str
    prompt_token_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    guide: Guide | None = None
    # Resumed after its worker died: the last ``resumed_tokens`` prompt tokens were generated (penalties, min_tokens, grammar).
    resumed_tokens: int = 0
    # W3C trace context of the gateway's span (``traceparent``, ``tracestate``): a worker's events join its trace; {} untraced.
    trace_context: dict[str, str] = {}
    # A reasoning model's thinking (None: no thinking markers): a guide applies only after it ends, and a budget ends it.
    reasoning: Reasoning | None = None
    pooling: PoolingParams | None = None  # a pooling request (common/pooling.py): one pass, no token sampled
    lora: str | None = None  # the LoRA adapter it runs with (the name a client gave as its model); None: the base model
    priority: int = 0  # lower is more urgent (vLLM's): admitted first, preempted last; batches: BATCH_PRIORITY
    images: list[ImageInput] = []  # an image-text model's images, in prompt order
    cache_salt: str | None = None  # seeds its prefix-cache hashes: one API key's blocks serve only that key
    affinity_key: str | None = None  # prompt_cache_key or x-session-id: the gateway routes it ahead of prefix hashing
    retain_s: float = 0.0  # cached-block retention asked for (a cache ttl): kept ahead of others


class Ready(Wire):
    """Worker -> gateway on connect: who I am and how much I can hold."""

    worker_name: str
    model: str
    max_model_len: int
    kv_capacity_tokens: int
    block_size: int
    max_batch_size: int
    device: str
    dtype: str
    # Digest of the tokenizer files and chat template (``ModelInfo``): a gateway without it asks once (``DescribeModel``).
    tokenizer_digest: str = ""
    pooling: PoolingInfo | None = None  # a pooling model's abilities (None: a generation model)
    lora: LoraInfo | None = None  # the LoRA adapters it serves (common/lora.py); None: it cannot apply adapters


class DescribeModel(Wire):
    """Gateway -> worker: send me your model's tokenizer and chat template (``ModelInfo``)."""

    tokenizer_digest: str = ""


class ModelInfo(Wire):
    """Worker -> gateway, on request: what the gateway needs to serve a model it has no files of.

    ``files`` are the tokenizer's saved files (``save_pretrained``: tokenizer.json and its configs),
    zlib-compressed as one msgpack map; the gateway needs no model files of its own.
    """

    model: str
    tokenizer_digest: str
    files: bytes  # zlib(msgpack({file name: bytes}))
    chat_template: str | None = None


class Heartbeat(Wire):
    """Both directions. From a worker it carries its load figures; from the gateway it is empty."""

    running: int = 0
    waiting: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    tokens_per_s: float = 0.0
    steps: int = 0
    peak_batch_size: int = 0
    preemptions: int = 0
    prefix_hit_tokens: int = 0
    prefix_queried_tokens: int = 0
    draining: bool = False  # finishing its requests before leaving: send it no new ones
    capacity_tokens_per_s: float = 0.0  # tokens/s of step time in recent steps that ran work: routing weighs it
    spec_proposed_tokens: int = 0  # speculative decoding: draft tokens proposed so far
    spec_accepted_tokens: int = 0  # ... and accepted by the verifying step
    # The KV store under the prefix cache (worker/kv_store), if any: workers with the same id read each other's blocks (one
    # store, one model fingerprint), so routing need not keep a prefix on the worker that computed it. Hits and misses count
    # blocks; the rest are since start, but size (the store's, last measured) and evictions (this worker's; Redis: the server's).
    kv_store_id: str = ""
    kv_store_hits: int = 0
    kv_store_misses: int = 0
    kv_store_read_bytes: int = 0
    kv_store_written_bytes: int = 0
    kv_store_read_seconds: float = 0.0
    kv_store_size_bytes: int = 0
    kv_store_evictions: int = 0
    lora: LoraLoad | None = None  # LoRA adapters running, waiting and resident (common/lora.py); None: it serves none
    cached_blocks: int = 0  # KV blocks its prefix cache holds now (what its KV events describe: worker/kv_events.py)


class AddRequests(Wire):
    """Gateway -> worker: requests that arrived together travel together."""

    requests: list[NewRequest]


class Abort(Wire):
    """Gateway -> worker: stop these requests and free their KV blocks."""

    request_ids: list[str]


class TokenLogprobs(Wire):
    """Log-probabilities at one sampled position, from the model's raw distribution (before
    penalties, bias, temperature or truncation, as vLLM reports them by default)."""

    logprob: float  # of the token that was chosen
    top_ids: list[int] = []  # most likely first
    top_logprobs: list[float] = []


class WorkerEvent(Wire):
    """Something that happened to one request inside a worker (admitted, prefill_chunk, preempted,
    finished...), with its wall-clock time, for the gateway's trace of that request."""

    name: str
    time_unix_nano: int
    attributes: dict[str, int | float | str | bool] = {}


class RequestOutput(Wire):
    """What one step produced for one request (a delta, never the whole sequence)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    bad_request: bool = False  # the error is the request's own fault (e.g. a grammar that does not compile)
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when the request asked for them
    prompt_logprobs: list[TokenLogprobs] | None = None  # once, with the first token: prompt tokens 1..n-1
    seq: int = 0  # this output's number among its request's outputs (0, 1, ...): a gap means one was lost
    events: list[WorkerEvent] = []  # worker events since the last output (tracing on)
    pooled: bytes | None = None  # a pooling request's vector: float32, little-endian (common/pooling.py)


class StepOutputs(Wire):
    """Worker -> gateway once per step, for the whole batch."""

    outputs: list[RequestOutput]
    batch_size: int = 0
    num_tokens: int = 0


class WorkerError(Wire):
    """Worker -> gateway: a failure that is not tied to one request's normal output."""

    message: str
    request_id: str | None = None


class Goodbye(Wire):
    """Worker -> gateway: leaving on purpose (shutdown); fail over at once, don't wait for expiry."""

    reason: str = ""


Message = Union[Ready, Heartbeat, AddRequests, Abort, StepOutputs, WorkerError, Goodbye, DescribeModel, ModelInfo, LoraCommand, LoraResult]  # fmt: skip

MESSAGE_TYPES: dict[MsgType, type] = {
    MsgType.READY: Ready,
    MsgType.HEARTBEAT: Heartbeat,
    MsgType.ADD_REQUESTS: AddRequests,
    MsgType.ABORT: Abort,
    MsgType.STEP_OUTPUTS: StepOutputs,
    MsgType.ERROR: WorkerError,
    MsgType.GOODBYE: Goodbye,
    MsgType.DESCRIBE_MODEL: DescribeModel,
    MsgType.MODEL_INFO: ModelInfo,
    MsgType.LORA_COMMAND: LoraCommand,
    MsgType.LORA_RESULT: LoraResult,
}
_TYPE_OF: dict[type, MsgType] = {cls: t for t, cls in MESSAGE_TYPES.items()}
_ENCODER = msgspec.msgpack.Encoder()
_DECODERS = {t: msgspec.msgpack.Decoder(cls) for t, cls in MESSAGE_TYPES.items()}


# How a connection's handshake ended (CURVE refusals too): libzmq's ZMQ_EVENT_HANDSHAKE_* (common/ has no zmq).
HANDSHAKE_SUCCEEDED = 0x1000
HANDSHAKE_EVENTS = {
    HANDSHAKE_SUCCEEDED: "succeeded",
    0x4000: "refused: the CURVE key is not authorized",  # ZMQ_EVENT_HANDSHAKE_FAILED_AUTH
    0x2000: "failed: protocol error (CURVE keys on one side only, or the wrong server key?)",  # ..._FAILED_PROTOCOL
    0x0800: "failed",  # ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL (connection closed mid-handshake, say)
}
HANDSHAKE_EVENT_MASK = sum(HANDSHAKE_EVENTS)


class ProtocolError(ValueError):
    """A frame that is not a valid message of this protocol version; receivers log and drop it."""


class VersionMismatch(ProtocolError):
    """A message from a peer that speaks another protocol version (its header says which)."""

    def __init__(self, version: int, msg_type: int, payload: bytes | memoryview) -> None:
        super().__init__(f"protocol version {version} (this side speaks {PROTOCOL_VERSION})")
        self.version = version
        self.msg_type = msg_type
        self.payload = payload

    def sender_name(self) -> str | None:
        """The worker name in a ``Ready`` of any version (version 1 sent maps, 2 arrays), for the log."""
        try:
            ready = msgspec.msgpack.decode(self.payload) if self.msg_type == MsgType.READY else None
        except msgspec.DecodeError:
            return None
        name = ready.get("worker_name") if isinstance(ready, dict) else ready[0] if isinstance(ready, list) and ready else None  # fmt: skip
        return name if isinstance(name, str) else None


def refusal(version: int, message: str) -> list[bytes] | None:
    """Why a worker is refused, as a ``WorkerError`` a peer of ``version`` reads (1: as a map); None for a newer version."""
    if version == PROTOCOL_VERSION:
        return encode(WorkerError(message))
    if version == 1:
        return [bytes((1, MsgType.ERROR)), _ENCODER.encode({"message": message, "request_id": None})]
    return None


def encode(msg: Message) -> list[bytes]:
    """Encode a message as ``[header, payload]`` frames."""
    return [bytes((PROTOCOL_VERSION, _TYPE_OF[type(msg)])), _ENCODER.encode(msg)]


def decode(frames: list[bytes] | list[memoryview]) -> Message:
    """Decode ``[header, payload]`` frames; raise ProtocolError on anything malformed (VersionMismatch
    for a message of another protocol version)."""
    if len(frames) != 2:
        raise ProtocolError(f"expected 2 frames, got {len(frames)}")
    header = bytes(frames[0])
    if len(header) != 2:
        raise ProtocolError(f"header must be 2 bytes, got {len(header)}")
    if header[0] != PROTOCOL_VERSION:
        raise VersionMismatch(header[0], header[1], frames[1])
    try:
        decoder = _DECODERS[MsgType(header[1])]
    except ValueError:
        raise ProtocolError(f"unknown message type {header[1]}") from None
    try:
        return decoder.decode(frames[1])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"bad {MsgType(header[1]).name} payload: {exc}") from None
