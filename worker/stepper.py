"""The engine's own thread: it loads the model, then steps whenever the engine has work (async scheduling);
and what the socket loop expects of an engine (``Stepped``) and of what steps it (``Stepper``).

The socket loop (worker/proc.py) never waits for a step: it takes the engine between two steps to
hand it requests and aborts, and sends each step's outputs while the next one runs.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:
    from common.protocol import Heartbeat, NewRequest, RequestOutput, StepOutputs

T = TypeVar("T")


class Blocks(Protocol):
    capacity_tokens: int
    block_size: int


class Stepped(Protocol):
    """What the loop needs of an engine (worker/engine.py; the benchmark's model-less one too)."""

    max_model_len: int
    max_num_seqs: int
    blocks: Blocks

    def add_request(self, new: NewRequest) -> None: ...
    def reject(self, request_id: str, error: str, num_prompt_tokens: int = 0, bad_request: bool = False) -> None: ...
    def abort(self, request_ids: list[str]) -> list[RequestOutput]: ...
    def fail_all(self, message: str) -> list[RequestOutput]: ...
    def has_work(self) -> bool: ...
    def step(self) -> StepOutputs: ...
    def load(self) -> Heartbeat: ...


class Stepper(Protocol):
    """What the socket loop needs of the thing that steps the engine: StepThread, or one that steps
    on the loop's own thread (the benchmark's fleet of model-less workers)."""

    wanted: bool

    def start(self, step: Callable[[], None], has_work: Callable[[], bool]) -> None: ...
    def fileno(self) -> int: ...
    def clear(self) -> None: ...
    def want(self) -> bool: ...
    def release(self) -> None: ...
    def stop(self) -> None: ...


class StepThread:
    """The one thread that runs the engine: its model loading (``call``), then every step (``start``).

    One thread for both because torch's CPU ops run on an OpenMP team that belongs to the thread
    calling them. A model loaded on the main thread and stepped on another leaves two teams; libgomp,
    then managing more threads than there are CPUs, lets idle workers sleep almost at once, and
    each of a step's many parallel regions waits for a wake-up: batch-1 steps took 9.5 ms, not 2.9.

    Once started it steps on its own while there is work, with no handoff between two steps. The
    socket loop takes the engine between two steps without waiting for one to end: ``want`` asks,
    and says whether it is granted; if not, the end of the running step is signalled on
    ``fileno()`` (it is in the loop's poller) and the next step waits for ``release``.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Future, Callable[..., object], tuple] | None] = queue.SimpleQueue()
        self._turn = threading.Condition()
        self._stepping = False  # a step runs: the engine is the step's
        self.wanted = False  # the socket loop asked for the engine: no new step starts
        self._stopped = False
        self._ended_r, self._ended_w = os.pipe()  # a byte at the end of each step
        os.set_blocking(self._ended_r, False)
        self._thread = threading.Thread(target=self._serve, name="engine", daemon=True)
        self._thread.start()

    def call(self, fn: Callable[..., T], *args: object) -> T:
        """Run ``fn`` on the engine thread and wait for its result (before ``start``)."""
        future: Future[T] = Future()
        self._jobs.put((future, fn, args))
        return future.result()

    def start(self, step: Callable[[], None], has_work: Callable[[], bool]) -> None:
        """Call ``step`` again and again while ``has_work()``; sleep while not (a ``release``, after
        which there may be new requests, wakes it)."""
        self._jobs.put((Future(), self._loop, (step, has_work)))

    def fileno(self) -> int:
        return self._ended_r

    def clear(self) -> None:
        """Forget the ends signalled so far (the outputs of those steps are posted already)."""
        try:
            os.read(self._ended_r, 1 << 16)  # one read drains the pipe (its buffer is 64 KiB)
        except BlockingIOError:
            pass

    def want(self) -> bool:
        """Ask for the engine; True when it is granted (no step runs, and none starts until
        ``release``). Not granted: the running step's end is signalled on ``fileno()``."""
        with self._turn:
            self.wanted = True
            return not self._stepping

    def release(self) -> None:
        with self._turn:
            self.wanted = False
            self._turn.notify_all()

    def stop(self) -> None:
        """Let the step that runs end, then end the thread."""
        with self._turn:
            self._stopped = True
            self._turn.notify_all()
        self._jobs.put(None)
        self._thread.join()
        os.close(self._ended_r)
        os.close(self._ended_w)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args = job
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to the caller of ``call``
                future.set_exception(exc)

    def _loop(self, step: Callable[[], None], has_work: Callable[[], bool]) -> None:
        while True:
            with self._turn:
                while not self._stopped and (self.wanted or not has_work()):
                    self._turn.wait()
                if self._stopped:
                    return
                self._stepping = True
            try:
                step()
            finally:
                with self._turn:
                    self._stepping = False
                os.write(self._ended_w, b".")
