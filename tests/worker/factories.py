"""Small builders for the worker's tests: schedulers and requests, and an engine driven until idle."""

from common.protocol import NewRequest, SamplingParams
from worker.block_manager import BlockManager
from worker.engine import Engine
from worker.request import Request
from worker.scheduler import Scheduler


def make_scheduler(
    num_blocks: int = 8,
    block_size: int = 4,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 1024,
) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size), max_num_seqs, max_num_batched_tokens, max_model_len)


def make_request(
    request_id: str, num_tokens: int, max_new_tokens: int = 8, token_ids: list[int] | None = None
) -> Request:
    """A request whose tokens differ from every other request's unless ``token_ids`` are given."""
    base = 1000 * sum(map(ord, request_id))
    tokens = token_ids if token_ids is not None else list(range(base + 1, base + num_tokens + 1))
    return Request(request_id, tokens, len(tokens), max_new_tokens, SamplingParams(), frozenset({0}))


def drain(engine: Engine, news: list[NewRequest] = ()) -> dict[str, list]:
    """Add ``news``, then every output of every request, by request id, until the engine is idle;
    checks that no KV block leaked."""
    for new in news:
        engine.add_request(new)
    out: dict[str, list] = {}
    while engine.has_work():
        for o in engine.step().outputs:
            out.setdefault(o.request_id, []).append(o)
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks, "KV blocks leaked"
    return out


def tokens(outputs: list) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]
