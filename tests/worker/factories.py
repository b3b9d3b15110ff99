"""Small builders for the scheduler's pure-Python tests."""

from common.protocol import SamplingParams
from worker.block_manager import BlockManager
from worker.request import Request
from worker.scheduler import Scheduler


def make_scheduler(
    num_blocks: int = 8, block_size: int = 4, max_num_seqs: int = 16, max_num_batched_tokens: int = 64, max_model_len: int = 1024
) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size), max_num_seqs, max_num_batched_tokens, max_model_len)


def make_request(request_id: str, num_tokens: int, max_new_tokens: int = 8, token_ids: list[int] | None = None) -> Request:
    """A request whose tokens differ from every other request's unless ``token_ids`` are given."""
    base = 1000 * sum(map(ord, request_id))
    tokens = token_ids if token_ids is not None else list(range(base + 1, base + num_tokens + 1))
    return Request(request_id, tokens, len(tokens), max_new_tokens, SamplingParams(), frozenset({0}))
