"""What becomes of a request when its worker fails: it resumes on another worker as its prompt
plus the tokens already delivered (a new wire id, the remaining budget, the same sampling), waits a
liveness period as an orphan when no worker of its model is there, and ends with an error only when
none comes or it was moved ``max_retries`` times. gateway/fleet/dispatch.py's ``Dispatcher`` extends this
with where requests go in the first place.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from common.protocol import Abort, FinishReason, NewRequest, RequestOutput
from gateway.errors import GenerationFailed
from gateway.fleet.roster import Outbox, Roster
from gateway.fleet.workers import RequestStream, WorkerInfo

log = logging.getLogger(__name__)


class Recovery:
    """The dispatcher's state these moves read and change (set by ``Dispatcher.__init__``)."""

    liveness: int
    max_retries: int
    clock: Callable[[], float]
    outbox: Outbox
    roster: Roster
    streams: dict[str, RequestStream]
    resumed: int
    _attempts: dict[str, RequestStream]
    _orphans: dict[str, tuple[RequestStream, str, float]]
    _with_pending: dict[bytes, WorkerInfo]

    def end(self, stream: RequestStream, error: GenerationFailed | None = None) -> None:
        """Close a stream (the dispatcher's)."""
        raise NotImplementedError

    def _assign(self, stream: RequestStream, request: NewRequest) -> None:
        """Send ``request`` to a worker of its model (the dispatcher's)."""
        raise NotImplementedError

    def _lost_output(self, worker: WorkerInfo, stream: RequestStream, seq: int) -> None:
        """An output of this request never arrived (seq jumped): the tokens delivered so far are
        exact, so it resumes from them as after a dead worker, under a new wire id (the worker is
        told to stop the old attempt; whatever else it sends for it is ignored)."""
        reason = f"worker {worker.ready.worker_name} lost output {stream.next_seq} of the request (got {seq})"
        log.warning("%s; resuming it", reason, extra={"request_id": stream.request_id})
        self.outbox.append((worker.identity, Abort([stream.wire_id])))
        worker.release(stream)
        self._resume(stream, reason)

    def _recover_unheld(self, worker: WorkerInfo) -> None:
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
                self._resume(stream, reason)

    def _purge(self, worker: WorkerInfo, reason: str) -> None:
        if not self.roster.remove(worker, reason):
            return
        self._with_pending.pop(worker.identity, None)
        log.warning("%s; resuming its %d in-flight requests elsewhere", reason, len(worker.inflight))
        for request_id in list(worker.inflight):
            stream = self.streams.get(request_id)
            if stream is not None:
                self._resume(stream, reason)

    def _resume(self, stream: RequestStream, reason: str) -> None:
        """Move a request whose worker died to another one, or end it if it can't be moved."""
        if stream.finished:
            return
        if not self.roster.available(stream.model, self.clock()):
            self._orphans.setdefault(stream.request_id, (stream, reason, self.clock()))
            return
        self._orphans.pop(stream.request_id, None)
        if stream.retries >= self.max_retries:
            self.end(stream, GenerationFailed(f"{reason}; the request was moved {stream.retries} times already"))
            return
        request = stream.resumed_request()
        if request.max_new_tokens <= 0:
            self._finish_delivered(stream)
            return
        stream.retries += 1
        stream.offset = len(stream.generated)
        self._attempts.pop(stream.wire_id, None)
        stream.wire_id = (
            f"{stream.request_id}.{stream.retries}"  # a late output of the old attempt can't pass for the new one's
        )
        self._attempts[stream.wire_id] = stream
        request.request_id = stream.wire_id
        self.resumed += 1
        stream.trace.resumed(reason, stream.retries, stream.offset)
        self._assign(stream, request)

    def _finish_delivered(self, stream: RequestStream) -> None:
        """Every token was delivered, only the finish was lost: it ends at its length."""
        final = RequestOutput(
            stream.request_id, [], FinishReason.LENGTH, len(stream.request.prompt_token_ids), len(stream.generated)
        )
        stream.queue.put_nowait(final)
        self.end(stream, None)
