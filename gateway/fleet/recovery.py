"""What becomes of a request when its worker fails: it resumes on another worker as its prompt
plus the tokens already delivered (a new wire id, the remaining budget, the same sampling), waits a
liveness period as an orphan when no worker of its model is there, and ends with an error only when
none comes or it was moved ``max_retries`` times. The dispatcher (gateway/fleet/dispatch.py) owns
one ``Recovery`` and hands it the requests to move; it sends them through the dispatcher's own
``assign`` and closes them through its ``end``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from common.protocol import Abort, FinishReason, NewRequest, RequestOutput
from gateway.errors import GenerationFailed, WorkerLost
from gateway.fleet.roster import Outbox, Roster
from gateway.fleet.workers import RequestStream, WorkerInfo

log = logging.getLogger(__name__)


class Recovery:
    """The moves of requests whose worker failed, and the orphans waiting for a worker."""

    def __init__(
        self,
        roster: Roster,
        outbox: Outbox,
        streams: dict[str, RequestStream],
        clock: Callable[[], float],
        liveness: int,
        max_retries: int,
        assign: Callable[[RequestStream, NewRequest], None],
        end: Callable[[RequestStream, GenerationFailed | None], None],
    ) -> None:
        self.roster = roster
        self.outbox = outbox
        self.streams = streams  # the dispatcher's open requests, by request id
        self.clock = clock
        self.liveness = liveness
        self.max_retries = max_retries
        self.assign = assign
        self.end = end
        self.resumed = 0  # requests moved to another worker after theirs died
        self.attempts: dict[str, RequestStream] = {}  # resumed requests by their current wire id
        # Requests whose worker died when no other was there: they wait a liveness period for one
        # to (re)register (workers reconnect after a gateway pause or restart) before failing.
        self.orphans: dict[str, tuple[RequestStream, str, float]] = {}

    def adopt(self, model: str) -> None:
        """A worker of ``model`` registered: its orphans resume there."""
        for stream, reason, _ in list(self.orphans.values()):
            if stream.model == model:
                self.resume(stream, reason)

    def expire(self, now: float, period: float) -> None:
        """End the orphans that waited longer than ``period`` for a worker."""
        for stream, reason, since in list(self.orphans.values()):
            if stream.finished or now - since > period:
                del self.orphans[stream.request_id]
                self.end(stream, WorkerLost(f"{reason}; no other worker can take the request over"))

    def worker_lost(self, worker: WorkerInfo, reason: str) -> None:
        """A purged worker's in-flight requests resume elsewhere."""
        for request_id in list(worker.inflight):
            stream = self.streams.get(request_id)
            if stream is not None:
                self.resume(stream, reason)

    def lost_output(self, worker: WorkerInfo, stream: RequestStream, seq: int) -> None:
        """An output of this request never arrived (seq jumped): the tokens delivered so far are
        exact, so it resumes from them as after a dead worker, under a new wire id (the worker is
        told to stop the old attempt; whatever else it sends for it is ignored)."""
        reason = f"worker {worker.ready.worker_name} lost output {stream.next_seq} of the request (got {seq})"
        log.warning("%s; resuming it", reason, extra={"request_id": stream.request_id})
        self.outbox.append((worker.identity, Abort([stream.wire_id])))
        worker.release(stream)
        self.resume(stream, reason)

    def recover_unheld(self, worker: WorkerInfo) -> None:
        """The worker says it holds nothing, yet requests sent to it ``liveness`` heartbeats ago
        are open: it never accepted them (a message lost or unreadable), or their last output was
        lost. Messages from one worker arrive in order, so their outputs would have come before
        this heartbeat. Each resumes from what was delivered (``max_retries`` times at most), the
        worker is not at fault: it counts as neither hung nor dead."""
        for request_id in list(worker.inflight):
            stream = self.streams.get(request_id)
            if stream is not None and worker.heartbeats - stream.heartbeats_at_assign > self.liveness:
                reason = f"worker {worker.ready.worker_name} does not hold the request (never accepted, or its last output was lost)"
                log.warning("%s; resuming it", reason, extra={"request_id": request_id})
                worker.release(stream)
                self.resume(stream, reason)

    def resume(self, stream: RequestStream, reason: str) -> None:
        """Move a request whose worker died to another one, or end it if it can't be moved."""
        if stream.finished:
            return
        if not self.roster.available(stream.model, self.clock()):
            self.orphans.setdefault(stream.request_id, (stream, reason, self.clock()))
            return
        self.orphans.pop(stream.request_id, None)
        if stream.retries >= self.max_retries:
            self.end(stream, GenerationFailed(f"{reason}; the request was moved {stream.retries} times already"))
            return
        request = stream.resumed_request()
        if request.max_new_tokens <= 0:
            self.finish_delivered(stream)
            return
        stream.retries += 1
        stream.offset = len(stream.generated)
        self.attempts.pop(stream.wire_id, None)
        stream.wire_id = (
            f"{stream.request_id}.{stream.retries}"  # a late output of the old attempt can't pass for the new one's
        )
        self.attempts[stream.wire_id] = stream
        request.request_id = stream.wire_id
        self.resumed += 1
        stream.trace.resumed(reason, stream.retries, stream.offset)
        self.assign(stream, request)

    def finish_delivered(self, stream: RequestStream) -> None:
        """Every token was delivered, only the finish was lost: it ends at its length."""
        final = RequestOutput(
            stream.request_id, [], FinishReason.LENGTH, len(stream.request.prompt_token_ids), len(stream.generated)
        )
        stream.queue.put_nowait(final)
        self.end(stream, None)
