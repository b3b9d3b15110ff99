"""What the worker's socket loop does with what arrives from a gateway (worker/proc.py owns one
``Inbound``): a message is read as it comes, even mid-step (``read``); what is for the engine
(new requests, aborts, adapter loads) waits in the inbox until the engine is held between two steps
(``apply``). A model description is answered at once. An AddRequests that does not decode
keeps the requests that do, and the others are answered with an error rather than left waiting.
"""

from __future__ import annotations

import logging
import time
from typing import NamedTuple

from common import protocol
from common.model_source import TokenizerBundle
from common.protocol import (
    Abort,
    AddRequests,
    DescribeModel,
    Heartbeat,
    ModelInfo,
    Ready,
    StepOutputs,
    WorkerError,
)
from common.salvage import salvage_requests
from worker.handshake import GatewayLink
from worker.lora.registry import answer
from worker.stepper import Stepped

log = logging.getLogger(__name__)


class Refused(NamedTuple):
    """Requests of an AddRequests that did not decode, to be answered with these errors."""

    request_ids_and_reasons: list[tuple[str, str]]


Inbox = list[tuple[GatewayLink, AddRequests | Abort | Refused | protocol.LoraCommand]]


class Inbound:
    """The messages that arrived for the engine, and which gateway owns each request it runs."""

    def __init__(self, engine: Stepped, name: str, ready: Ready, tokenizer: TokenizerBundle | None) -> None:
        self.engine = engine
        self.name = name
        self.ready = ready
        self.tokenizer = tokenizer
        self.owner: dict[str, GatewayLink] = {}  # request id -> the gateway that sent it
        self._inbox: Inbox = []  # what arrived for the engine, applied between steps

    def waiting(self) -> bool:
        """Something waits for the engine's next hold."""
        return bool(self._inbox)

    def arrived(self) -> int:
        """How many new requests wait for the engine (a heartbeat sent mid-step counts them)."""
        return sum(len(msg.requests) for _, msg in self._inbox if isinstance(msg, AddRequests))

    def read(self, link: GatewayLink) -> bool:
        """Read every message waiting on a link (a step may be running: what is for the engine
        waits in the inbox); True if anything valid arrived."""
        got = False
        while (frames := link.receive()) is not None:
            try:
                msg = protocol.decode(frames)
            except protocol.ProtocolError as exc:
                msg = self._salvage(link, frames, exc)
                if msg is None:
                    continue
            if isinstance(
                msg, WorkerError
            ):  # a refusal (a live worker has our name): the link stays silent and retries
                log.error("the gateway at %s: %s", link.address, msg.message)
                continue
            got = True
            link.last_heard = time.monotonic()
            if isinstance(msg, AddRequests | Abort | protocol.LoraCommand):
                self._inbox.append((link, msg))
            elif isinstance(msg, DescribeModel):
                self._describe(link)
            elif not isinstance(msg, Heartbeat):
                log.warning("unexpected %s from the gateway at %s", type(msg).__name__, link.address)
        return got

    def apply(self) -> None:
        """Engine held: hand it what arrived, in order; aborted requests' final outputs go back to
        the gateways that asked."""
        inbox, self._inbox = self._inbox, []
        for link, msg in inbox:
            if link.sock is None:
                continue  # the link closed since: its gateway has moved those requests
            if isinstance(msg, AddRequests):
                for new in msg.requests:
                    self._own(link, new.request_id)
                    self.engine.add_request(new)
            elif isinstance(msg, protocol.LoraCommand):  # a load or unload of an adapter, between two steps
                link.send(answer(getattr(self.engine, "loras", None), msg, self.ready))
            elif isinstance(msg, Refused):
                for request_id, why in msg.request_ids_and_reasons:
                    self._own(link, request_id)
                    self.engine.reject(request_id, why, bad_request=True)
            else:
                link.send(StepOutputs(self.engine.abort(msg.request_ids)))
                for request_id in msg.request_ids:
                    if self.owner.get(request_id) is link:
                        del self.owner[request_id]
                    link.requests.discard(request_id)

    def _own(self, link: GatewayLink, request_id: str) -> None:
        self.owner[request_id] = link
        link.requests.add(request_id)

    def _describe(self, link: GatewayLink) -> None:
        """Send the model's tokenizer and chat template: the gateway has no files of its own."""
        if self.tokenizer is None:
            link.send(WorkerError(f"worker {self.name} has no tokenizer bundle to describe {self.ready.model}"))
            return
        bundle = self.tokenizer
        link.send(ModelInfo(self.ready.model, bundle.digest, bundle.packed, bundle.chat_template))

    def _salvage(self, link: GatewayLink, frames: list[bytes], exc: protocol.ProtocolError) -> AddRequests | None:
        """A message that did not decode: if it is an AddRequests, keep the requests that do decode
        and answer the others with an error (the gateway would otherwise wait on them until its
        timeout); anything else is dropped."""
        salvaged = salvage_requests(frames)
        if salvaged is None:
            log.warning("dropped a malformed message: %s", exc)
            return None
        good, bad = salvaged
        log.warning(
            "an AddRequests did not decode (%s): %d of its requests run, %d are refused", exc, len(good), len(bad)
        )
        self._inbox.append((link, Refused(bad)))
        return AddRequests(good)
