"""Who the gateway serves with: the workers registered per model, the ones still joining, and why
any was refused or left. No sockets: gateway/fleet/dispatch.py hands it decoded messages and the time,
and what it has to tell a peer goes to the shared ``outbox`` for the ROUTER side to send.

A worker registers with ``Ready``, naming its model. The first worker of a model whose tokenizer
this gateway does not hold is asked for it (``DescribeModel``; it answers ``ModelInfo``); until the
gateway has loaded it, that model's workers wait in ``joining``. A worker whose tokenizer differs
from the one its model name already has here is refused, and so is one whose name a live worker
holds; each is told why, in a ``WorkerError``.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import NamedTuple

from common.protocol import DescribeModel, Goodbye, Heartbeat, Message, ModelInfo, Ready, WorkerError
from gateway.errors import NoWorkerAvailable
from gateway.fleet.workers import ModelPool, StartFailures, WorkerInfo

log = logging.getLogger(__name__)

Outbox = deque[tuple[bytes, Message]]


class Admitted(NamedTuple):
    """A worker now registered, and the earlier registration of its name it replaces (if any)."""

    worker: WorkerInfo
    stale: WorkerInfo | None


class Roster:
    def __init__(
        self, interval: float, liveness: int, learns: bool, reachable: Callable[[bytes], bool], outbox: Outbox
    ) -> None:
        """``learns``: tokenizers are loaded from the workers' ModelInfo (False: a model's first
        digest is taken on trust, as the socket tests and the fleet benchmark want). ``reachable``
        says whether the ROUTER can still route to an identity (it sends that peer a heartbeat)."""
        self.interval = interval
        self.liveness = liveness
        self.learns = learns
        self.reachable = reachable
        self.outbox = outbox
        self.workers: dict[bytes, WorkerInfo] = {}
        self.models: dict[str, ModelPool] = {}
        self.joining: dict[bytes, tuple[Ready, float]] = {}  # waiting for their model's tokenizer: (Ready, last heard)
        self.departed: deque[dict] = deque(maxlen=16)  # recently dropped workers, for operators
        self.departures = 0  # registrations dropped since start (left, died, unreachable, replaced)
        self.start_failures = StartFailures()  # workers that said why they could not start (/health)
        self._refused: set[tuple[str, str]] = set()  # (worker name, why) already logged
        self._identity_of: dict[str, bytes] = {}  # worker name -> its registered identity (one per name)

    def limits(self, model: str) -> tuple[int, int]:
        """(max_model_len, kv capacity) that every registered worker of ``model`` can take; 503 if none."""
        pool = self.models.get(model)
        if pool is None or not pool.workers:
            raise NoWorkerAvailable(
                f"no worker of `{model}` is registered; start one with `llmpool worker --model ...`"
            )
        return pool.limits()

    def available(self, model: str, now: float) -> list[WorkerInfo]:
        """Workers of ``model`` that take new requests (registered and not draining)."""
        pool = self.models.get(model)
        return pool.available(now) if pool is not None else []

    def register(self, identity: bytes, ready: Ready, now: float) -> Admitted | None:
        """A worker says hello: admit it, or (its model's tokenizer unknown here) let it join while
        the gateway learns the tokenizer, or refuse it."""
        holder = self._name_holder(ready.worker_name, identity, now)
        if holder is not None:
            why = f"another live worker is registered as {ready.worker_name!r} ({holder.decode(errors='replace')}); give each worker its own --worker-name"
            self.refuse(identity, ready.worker_name, why)
            return None
        pool = self.models.setdefault(ready.model, ModelPool(ready.model))
        if pool.digest is None and not self.learns:
            pool.digest = ready.tokenizer_digest  # nothing to load: take it on trust
        if pool.digest is not None and ready.tokenizer_digest != pool.digest:
            self.refuse(
                identity,
                ready.worker_name,
                f"its tokenizer or chat template for {ready.model!r} differs from the one its other workers brought",
            )
            return None
        if pool.digest is None:
            self.joining[identity] = (ready, now)
            self._ask_description(pool, now)
            return None
        return self._admit(identity, ready, pool, now)

    def refuse(self, identity: bytes, name: str | None, why: str) -> None:
        """Log it and tell the worker why."""
        self.outbox.append((identity, WorkerError(self.refusal(identity, name, why))))

    def refusal(self, identity: bytes, name: str | None, why: str) -> str:
        """Log a refusal (once: the worker retries every liveness period); what to tell the worker."""
        if (name, why) not in self._refused:
            self._refused.add((name, why))
            log.error("refused worker %s: %s", name if name is not None else repr(identity[:64]), why)
        return f"the gateway refused to register this worker: {why}"

    def _name_holder(self, name: str, identity: bytes, now: float) -> bytes | None:
        """The identity of another live worker, registered or joining, that goes by ``name``: a
        second process started with the same --worker-name. Admitting it would unregister the first,
        which re-registers and unregisters the second, endlessly. A worker that restarted or
        reconnected comes back under a new identity after its old connection closed: the old one is
        then unreachable (ROUTER_MANDATORY), or silent for two heartbeats, and is replaced."""
        fresh = self.interval * (self.liveness - 2)
        held = self._identity_of.get(name)
        others = (
            [held]
            if held is not None
            and held != identity
            and held in self.workers
            and self.workers[held].expiry - now > fresh
            else []
        )
        others += [
            other
            for other, (r, heard) in self.joining.items()
            if r.worker_name == name and other != identity and now - heard < 2 * self.interval
        ]
        return next((other for other in others if self.reachable(other)), None)

    def _admit(self, identity: bytes, ready: Ready, pool: ModelPool, now: float) -> Admitted:
        self.joining.pop(identity, None)
        previous = self.workers.get(self._identity_of.get(ready.worker_name, b""))
        worker = WorkerInfo(identity, ready, now + self.interval * self.liveness, last_progress=now)
        self._identity_of[ready.worker_name] = identity
        self.workers[identity] = pool.workers[identity] = worker
        pool.changed()
        log.info(
            "worker %s registered for %s (%s, %s, %d KV tokens)",
            ready.worker_name,
            ready.model,
            ready.device,
            ready.dtype,
            ready.kv_capacity_tokens,
        )
        return Admitted(worker, previous if previous is not None and previous.identity != identity else None)

    def remove(self, worker: WorkerInfo, reason: str) -> bool:
        """Drop a registration (False if it was gone already); its requests are the caller's to move."""
        if self.workers.pop(worker.identity, None) is None:
            return False
        if self._identity_of.get(worker.ready.worker_name) == worker.identity:
            del self._identity_of[worker.ready.worker_name]
        pool = self.models[worker.ready.model]
        pool.workers.pop(worker.identity, None)
        pool.changed()
        self.departed.append(
            {"name": worker.ready.worker_name, "model": worker.ready.model, "reason": reason, "at": time.time()}
        )
        self.departures += 1
        return True

    def forgive(self, late: float) -> None:
        """Liveness counts the time since a worker's last message was *read*. A tick that comes
        ``late`` (this process was stopped, or its loop blocked) means nothing was read meanwhile:
        the workers' messages wait in the socket, so that time is nobody's silence. Move their
        deadlines by it; the receive loop reads the backlog before the next tick judges."""
        if late <= 0:
            return
        if late > self.interval:
            log.warning("the gateway did not run for %.1f s; not counting that against its workers", late)
        for worker in self.workers.values():
            worker.expiry += late
            worker.last_progress += late

    # ---- joining: learning a model's tokenizer ---------------------------------------------------

    def _ask_description(self, pool: ModelPool, now: float) -> None:
        """Ask one joining worker of ``pool``'s model for its tokenizer, unless one was asked within
        a liveness period (its answer may still come; a dead one is replaced by the next joiner)."""
        if (
            pool.describing is not None
            and pool.describing[0] in self.joining
            and now - pool.describing[1] < self.interval * self.liveness
        ):
            return
        asked = next((identity for identity, (ready, _) in self.joining.items() if ready.model == pool.name), None)
        if asked is None:
            pool.describing = None
            return
        pool.describing = (asked, now)
        log.info("learning the tokenizer of %s from worker %s", pool.name, self.joining[asked][0].worker_name)
        self.outbox.append((asked, DescribeModel(self.joining[asked][0].tokenizer_digest)))

    def joining_message(self, identity: bytes, msg: Message, now: float) -> ModelInfo | None:
        """A message from a joining worker; a ModelInfo to load is returned (then ``learned``)."""
        ready, _ = self.joining[identity]
        self.joining[identity] = (ready, now)
        if isinstance(msg, Goodbye):
            del self.joining[identity]
        elif isinstance(msg, WorkerError):
            log.error("worker %s: %s", ready.worker_name, msg.message)
        elif isinstance(msg, ModelInfo):
            pool = self.models.setdefault(msg.model, ModelPool(msg.model))
            if pool.learning:
                return None  # another answer is being loaded; it admits the joiners
            pool.learning = pool.digest is None
            return msg
        return None

    def learned(self, identity: bytes, info: ModelInfo, error: Exception | None, now: float) -> list[Admitted]:
        """The tokenizer ``info`` brought is loaded (or failed to, with ``error``): admit every joining
        worker that brought the same one, refuse those that brought another."""
        pool = self.models[info.model]
        if pool.learning:
            pool.learning = False
            if error is not None:
                log.error(
                    "could not load the tokenizer of %s that worker %r sent: %s", info.model, identity[:64], error
                )
                self.joining.pop(identity, None)
                pool.describing = None
                self._ask_description(pool, now)
                return []
            pool.digest = info.tokenizer_digest
            log.info("serving %s (tokenizer %s)", info.model, info.tokenizer_digest[:12])
        admitted = []
        for joiner, (ready, _) in list(self.joining.items()):
            if ready.model != info.model:
                continue
            if ready.tokenizer_digest == pool.digest:
                admitted.append(self._admit(joiner, ready, pool, now))
            else:
                del self.joining[joiner]
                self.refuse(
                    joiner,
                    ready.worker_name,
                    f"its tokenizer or chat template for {ready.model!r} differs from the one its other workers brought",
                )
        return admitted

    def tend_joiners(self, now: float) -> None:
        """Keep joining workers alive (they count the gateway's silence too), forget silent ones, and
        ask another worker when the one asked for a tokenizer did not answer."""
        for identity, (_, heard) in list(self.joining.items()):
            if now - heard > self.interval * self.liveness or not self.reachable(identity):
                del self.joining[identity]
        for pool in self.models.values():
            if pool.digest is None and not pool.learning:
                self._ask_description(pool, now)

    def snapshot(self, pinned: Mapping[bytes | None, int] | None = None) -> dict:
        """The pool for /workers; ``pinned``: the open WebSockets pinned to each worker."""
        pinned = pinned or {}
        return {
            "workers": [w.snapshot(pinned.get(w.identity, 0)) for w in self.workers.values()],
            "joining": [{"name": ready.worker_name, "model": ready.model} for ready, _ in self.joining.values()],
            "departed": list(self.departed),
            "departures": self.departures,
        }


GATEWAY_HEARTBEAT = Heartbeat()  # what the gateway's heartbeats say: nothing (the ROUTER side encodes it once)
