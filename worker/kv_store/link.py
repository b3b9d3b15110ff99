"""The engine's side of the KV store: look a prompt's blocks up as it arrives, load them at
admission, write computed prompt blocks behind the steps.

- **Lookup** (``lookup``, at ``add_request``): a reader thread computes the prompt's block keys and
  reads the blocks the prefix cache lacked at arrival, as far as the store has them in a row, into
  host memory (at most STAGING_LIMIT bytes staged for requests not yet admitted).
- **Load** (``load``, at admission, after the prefix cache's own hits): the staged blocks that follow
  those hits go into free blocks (one copy per layer, worker/runner/kv_blocks.py), registered in the
  prefix cache like computed ones; the request's computed-token counter moves past them, so the
  scheduler computes only the rest. The scheduler waits for a lookup only when it has nothing else
  to run (``ready``), so running streams never stall on the store.
- **Write-behind** (``write_behind``, after each step): every full prompt block not known to be
  stored is pinned (a reference, so it is not reused meanwhile) and handed to a writer thread, which
  reads it straight from the cache, writes it, and hands it back (``release_written``, next step).
  A block this worker stored or loaded lately is skipped; one the prefix cache served is re-marked
  used in the store at most once a minute, so hot prefixes are not evicted from under other workers.
  A retaining request's blocks (``retain_s``) are handed over every time, with their retention's end.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from worker.block_manager import BlockManager
from worker.kv_store import record
from worker.kv_store.tier import Block, Tier
from worker.request import Request

log = logging.getLogger(__name__)

STAGING_LIMIT = 1 << 30  # bytes read ahead for waiting requests (one lookup may pass it alone)
REFRESH_S = 60.0  # a block stored or loaded this recently is not handed to the writer again
KNOWN_LIMIT = 1 << 18  # keys remembered as stored
MAINTAIN_EVERY_S = 5.0


class BlockIO(Protocol):
    """The runner's hook (worker/runner/kv_blocks.py)."""

    payload_bytes: int

    def block_parts(self, block_id: int) -> list[memoryview]: ...
    def copy_in(self, block_ids: list[int], staged: memoryview) -> None: ...


@dataclass(slots=True, eq=False)
class Lookup:
    """One request's business with the store: its prompt blocks' keys, and what was staged for it."""

    tokens: tuple[int, ...]  # the prompt's full blocks
    start: int  # first block read (the prefix cache had those before, at arrival)
    end: int  # blocks worth reading: all but the prompt's last token
    blocks: list[Block] = field(default_factory=list)
    found: int = 0
    staging: np.ndarray | None = None
    written: int = 0  # prompt blocks handed to the writer (or known to be stored) so far
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False
    claimed: bool = False  # loaded (or found useless) at the first admission: a preempted request recomputes
    read_s: float = 0.0  # the reader's time on it
    waited_s: float = 0.0  # the scheduler's wait for it
    salt: bytes = b""  # its prefix-cache salt (an API key's, an adapter's): its keys are its tenant's alone
    retain_s: float = 0.0  # its blocks' retention (a ttl): written, or renewed, with their end time
    marks: list[bytes] = field(default_factory=list)  # per block, the pixel digests of the images it holds tokens of


@dataclass(slots=True)
class StoreCounters:
    hits: int = 0  # blocks loaded
    misses: int = 0  # blocks looked up and not loaded (absent, damaged, or no free block)
    read_bytes: int = 0
    written_bytes: int = 0
    read_seconds: float = 0.0  # the reader's time for the blocks it found (read speed: read_bytes / this)
    errors: int = 0


class KVStore:
    """One worker's link to a tier; every public method but the threads' runs on the engine thread."""

    def __init__(self, tier: Tier, io: BlockIO, fingerprint: bytes, blocks: BlockManager) -> None:
        self.tier = tier
        self.io = io
        self.fingerprint = fingerprint
        self.blocks = blocks
        self.block_size = blocks.block_size
        self.counters = StoreCounters()
        self._known: OrderedDict[bytes, float] = OrderedDict()
        self._pinned = 0
        self._pin_limit = max(1, blocks.num_blocks // 4)
        self._lookups: queue.Queue[Lookup] = queue.Queue()
        self._writes: queue.Queue[list[tuple[int, Block]]] = queue.Queue()
        self._released: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._staged = 0
        self._staging_turn = threading.Condition()
        self._maintained = 0.0
        for name, target in (("kv-store-reader", self._read_loop), ("kv-store-writer", self._write_loop)):
            threading.Thread(target=target, name=name, daemon=True).start()
        self._writes.put([])  # a first maintain(): the folder's size is scanned at start

    # ---- lookups and loads ---------------------------------------------------------------------

    def lookup(self, request: Request, cached_blocks: int) -> None:
        """Start reading the blocks of ``request``'s prompt past the ``cached_blocks`` the prefix
        cache holds now; a prompt whose logprobs are wanted reuses nothing but is still written."""
        size = self.block_size
        full = request.num_prompt_tokens // size
        if not full:
            return  # not one full block: nothing to read or write
        end = 0 if request.sampling.prompt_logprobs is not None else (request.num_prompt_tokens - 1) // size
        job = Lookup(tuple(request.token_ids[: full * size]), min(cached_blocks, end), end)
        job.salt = (request.cache_salt or "").encode()
        if request.images:  # a block holding an image's tokens is keyed by its pixels too, as in the prefix cache
            job.marks = [b"".join(d.encode() for d in request.block_key(i, size)[size:]) for i in range(full)]
        job.retain_s = request.retain_s
        if job.retain_s:  # keyed now: its blocks' retention is renewed even if the prefix cache serves them
            job.blocks = self._keys(job)
        request.kv_store = job
        self._lookups.put(job)

    def ready(self, request: Request, wait: bool) -> bool:
        """Whether ``request`` may be admitted: its lookup ended, or it is not needed (the prefix
        cache covers what it would read); ``wait``: nothing else runs, so wait for it."""
        job = request.kv_store
        if job is None or job.done.is_set() or self.blocks.cached_prefix_blocks(request) >= job.end:
            return True
        if wait:
            began = time.perf_counter()
            job.done.wait()
            job.waited_s += time.perf_counter() - began
        return wait

    def load(self, request: Request) -> int:
        """After the prefix cache's hits: load the staged blocks that follow them; tokens loaded."""
        job = request.kv_store
        if job is None or job.claimed:
            return 0
        job.claimed = True
        if not job.done.is_set():  # admitted without it (the prefix cache covers it): what it reads is dropped
            job.cancelled = True
            return 0
        first = len(request.block_ids)
        wanted = max(0, job.end - first)
        ids: list[int] = []
        if job.staging is not None and job.start <= first < job.start + job.found:
            skip = first - job.start
            ids = self.blocks.adopt(request, job.found - skip)
            if ids:
                payload = self.io.payload_bytes
                self.io.copy_in(ids, memoryview(job.staging)[skip * payload : (skip + len(ids)) * payload])
                now = time.monotonic()
                for block in job.blocks[first : first + len(ids)]:
                    self._remember(block.key, now)
        self._unstage(job)
        if wanted:
            log.info(
                "request %s: %d of %d blocks from the KV store (read in %.0f ms, waited %.0f ms for it)",
                request.request_id,
                len(ids),
                wanted,
                job.read_s * 1000,
                job.waited_s * 1000,
                extra={"request_id": request.request_id},
            )
        self.counters.hits += len(ids)
        self.counters.misses += wanted - len(ids)
        if request.events is not None:
            request.record("kv_store_load", blocks=len(ids), wanted=wanted)
        return len(ids) * self.block_size

    def cancel(self, request: Request) -> None:
        """The request ends: drop what was staged for it."""
        job = request.kv_store
        if job is not None:
            job.cancelled = True
            self._unstage(job)

    def _unstage(self, job: Lookup) -> None:
        with self._staging_turn:
            if job.staging is not None:
                self._staged -= job.staging.nbytes
                job.staging = None
                self._staging_turn.notify_all()

    def _read_loop(self) -> None:
        while True:
            job = self._lookups.get()
            try:
                self._read(job)
            except Exception as exc:  # a store that fails costs speed, never the worker
                self._failed("read", exc)
            finally:
                job.done.set()
                self._lookups.task_done()

    def _keys(self, job: Lookup) -> list[Block]:
        size = self.block_size
        chunks = [record.token_bytes(job.tokens[i * size : (i + 1) * size]) for i in range(len(job.tokens) // size)]
        keys = record.chain_keys(self.fingerprint + job.salt, job.tokens, size, len(chunks), job.marks)
        return [Block(k, c) for k, c in zip(keys, chunks)]

    def _read(self, job: Lookup) -> None:
        job.blocks = job.blocks or self._keys(job)
        if job.cancelled or job.start >= job.end:
            return
        began = time.perf_counter()
        wanted = job.blocks[job.start : job.end]
        present = self.tier.count_run(wanted)
        if not present:
            return
        payload = self.io.payload_bytes
        with self._staging_turn:
            self._staging_turn.wait_for(
                lambda: job.cancelled or not self._staged or self._staged + present * payload <= STAGING_LIMIT
            )
            if job.cancelled:
                return
            job.staging = np.empty(present * payload, dtype=np.uint8)
            self._staged += job.staging.nbytes
        view = memoryview(job.staging)
        job.found = self.tier.read_run(wanted[:present], lambda i: view[i * payload : (i + 1) * payload])
        job.read_s = time.perf_counter() - began
        self.counters.read_bytes += job.found * payload
        self.counters.read_seconds += job.read_s
        if job.cancelled:
            self._unstage(job)

    # ---- write-behind --------------------------------------------------------------------------

    def write_behind(self, request: Request) -> None:
        """Hand the writer the request's newly computed full prompt blocks (after a step)."""
        job = request.kv_store
        if job is None or not (job.done.is_set() or job.retain_s):
            return
        limit = min(len(request.block_hashes), len(job.blocks))
        now = time.monotonic()
        keep_until = time.time() + job.retain_s if job.retain_s else 0.0
        batch = []
        index = job.written
        while index < limit and self._pinned < self._pin_limit:
            block = job.blocks[index]
            block.keep_until = keep_until
            seen = self._known.get(block.key)
            if seen is None or now - seen > REFRESH_S or keep_until:  # a retention is renewed each time
                block_id = request.block_ids[index]
                self.blocks.pin(block_id)
                self._pinned += 1
                self._remember(block.key, now)
                batch.append((block_id, block))
            index += 1
        job.written = index
        if batch:
            self._writes.put(batch)

    def release_written(self) -> None:
        """Give back the blocks the writer is done with (before each step's scheduling)."""
        while True:
            try:
                block_id = self._released.get_nowait()
            except queue.Empty:
                return
            self.blocks.unpin(block_id)
            self._pinned -= 1

    def flush(self) -> None:
        """Wait for every lookup and write handed over so far, and take back their blocks (tests, shutdown)."""
        self._lookups.join()
        self._writes.join()
        self.release_written()

    def close(self, timeout: float = 10.0) -> None:
        """At exit: give the writes handed over so far up to ``timeout`` seconds to end (a worker
        stopped right after a prefill leaves its blocks for the next one)."""
        deadline = time.monotonic() + timeout
        while self._writes.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.05)
        if self._writes.unfinished_tasks:
            log.warning("KV store: stopped with %d batches of blocks not written", self._writes.unfinished_tasks)

    def _remember(self, key: bytes, now: float) -> None:
        self._known[key] = now
        self._known.move_to_end(key)
        if len(self._known) > KNOWN_LIMIT:
            self._known.popitem(last=False)

    def _write_loop(self) -> None:
        while True:
            batch = self._writes.get()
            try:
                for block_id, block in batch:
                    try:
                        self.counters.written_bytes += self.tier.ensure(block, self.io.block_parts(block_id))
                    except Exception as exc:  # as for reads
                        self._failed("write", exc)
                    finally:
                        self._released.put(block_id)
                now = time.monotonic()
                if now - self._maintained > MAINTAIN_EVERY_S or not batch:
                    self._maintained = now
                    self.tier.maintain()
            except Exception as exc:
                self._failed("maintain", exc)
            finally:
                self._writes.task_done()

    def figures(self) -> dict[str, int | float | str]:
        """The store's share of a heartbeat (common/protocol.py ``Heartbeat.kv_store_*``)."""
        c, usage = self.counters, self.tier.usage
        return {
            "kv_store_id": f"{self.tier.store_id}-{self.fingerprint.hex()}",
            "kv_store_hits": c.hits,
            "kv_store_misses": c.misses,
            "kv_store_read_bytes": c.read_bytes,
            "kv_store_written_bytes": c.written_bytes,
            "kv_store_read_seconds": round(c.read_seconds, 3),
            "kv_store_size_bytes": usage.size_bytes,
            "kv_store_evictions": usage.evictions,
        }

    def _failed(self, what: str, exc: Exception) -> None:
        self.counters.errors += 1
        if self.counters.errors <= 3 or self.counters.errors % 100 == 0:
            log.warning(
                "KV store (%s): %s failed (%d failures so far): %s: %s",
                self.tier.description,
                what,
                self.counters.errors,
                type(exc).__name__,
                exc,
            )
