"""Each step's batch, from rank 0 to the other ranks, as vLLM V1 and SGLang send it.

Rank 0 schedules; before each model step it broadcasts what the step computes (per row: the new
tokens, their positions, the block table; nothing else a forward reads) as one msgpack message on
the control group. The other ranks rebuild the batch as plain requests and run the same forward on
their shards (its all-reduces keep the ranks in step); rank 0 alone samples, so sampling state,
grammars and prompt logprobs live only there. An empty batch is the signal to stop.
"""

from __future__ import annotations

import logging

import msgspec
import torch

from common.protocol import SamplingParams
from worker.request import Request
from worker.scheduler import ScheduledBatch

log = logging.getLogger(__name__)


class Row(msgspec.Struct, array_like=True):
    """One request's share of a step: ``tokens`` are its positions ``start..start+len(tokens)``."""

    request_id: str
    start: int
    tokens: list[int]
    num_tokens: int  # all its tokens so far (a row whose step ends there is sampled)
    block_ids: list[int]  # (no adapter's salt: adapters are refused with more than one rank)


class Step(msgspec.Struct, array_like=True):
    rows: list[Row]


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Step)


def encode(batch: ScheduledBatch) -> bytes:
    return _ENCODER.encode(
        Step(
            [
                Row(
                    r.request_id,
                    r.num_computed_tokens,
                    r.token_ids[r.num_computed_tokens : r.num_computed_tokens + n],
                    r.num_tokens,
                    r.block_ids,
                )
                for r, n in zip(batch.requests, batch.num_new_tokens)
            ]
        )
    )


def decode(message: bytes) -> ScheduledBatch:
    """The batch as a follower runs it: requests whose tokens outside this step are placeholders
    (no forward reads them) and that sample nothing of their own."""
    batch = ScheduledBatch()
    for row in _DECODER.decode(message).rows:
        end = row.start + len(row.tokens)
        request = Request(
            request_id=row.request_id,
            token_ids=[0] * row.start + row.tokens + [0] * (row.num_tokens - end),
            num_prompt_tokens=row.num_tokens,
            max_new_tokens=0,
            sampling=SamplingParams(),
            stop_token_ids=frozenset(),
            num_computed_tokens=row.start,
            block_ids=row.block_ids,
        )
        batch.add(request, len(row.tokens))
    return batch


class Leader:
    """Rank 0's side: ``send`` each batch before running it."""

    def __init__(self, control: object) -> None:
        self.control = control

    def send(self, batch: ScheduledBatch) -> None:
        _broadcast(encode(batch), self.control)

    def stop(self) -> None:
        _broadcast(b"", self.control)


def follow(runner: object, control: object) -> None:
    """A follower's life after start: run every step rank 0 sends, until it sends the stop."""
    steps = 0
    while True:
        message = _broadcast(None, control)
        if not message:
            log.info("rank 0 stopped the group after %d steps", steps)
            return
        with torch.inference_mode():
            runner.logits(decode(message))
        steps += 1


def _broadcast(message: bytes | None, control: object) -> bytes:
    import torch.distributed as dist

    box = [message]
    dist.broadcast_object_list(box, src=0, group=control)
    return box[0]
