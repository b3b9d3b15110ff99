"""The store in a folder: one file per block, shared by any number of worker processes.

Layout: ``DIR/store-id`` (a random id made by the first worker: workers that see the same id share
blocks, which is how the gateway knows), and per fingerprint ``DIR/<fingerprint>/fingerprint.json``
(what the blocks are for, for ``llmpool kv-store stats``) and ``DIR/<fingerprint>/<ab>/<key>.kvb``.

Safe with many writers and readers at once without locks: a record is written under a temporary name
in the same folder and renamed into place (rename is atomic), so a reader sees a whole file or none;
two workers writing one block write equivalent records and the last rename wins. A crash mid-write
leaves a temporary file, removed by a later scan. Readers check every record (worker/kv_store/record.py)
and delete one that fails (if it is still the file they read).

The size bound (``--kv-store-size``) is kept by scanning now and then (at start, then whenever this
worker has written 5% of the bound since its last scan): over the bound, the least recently used
files go, by modification time, which a read refreshes (access times are often not kept: noatime).
One worker evicts at a time (a lock file); the bound can be passed by what others wrote since.

Retention (a request's cache ttl): a retained block's file gets its retention's end as its
modification time, in the future, so eviction takes it after every unretained file until then, and
reads do not move it back; after that it counts as last used when its retention ended.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from worker.kv_store import record
from worker.kv_store.fingerprint import Fingerprint
from worker.kv_store.record import Buffer
from worker.kv_store.tier import Block, TierUsage

try:
    import fcntl
except ImportError:  # not on POSIX: evictions are not serialized, which costs only duplicate work
    fcntl = None

log = logging.getLogger(__name__)

SUFFIX = ".kvb"
TEMP_PREFIX = ".tmp-"
TEMP_MAX_AGE_S = 600.0  # a temporary file this old is a crashed writer's
TOUCH_AFTER_S = 60.0  # a read refreshes a file's time when it is older than this (one write per minute at most)
EVICT_TO = 0.9  # an eviction goes down to this share of the bound, so it does not run after every write
RESCAN_SHARE = 0.05


def store_id(root: Path) -> str:
    """The folder's id, made once by whichever worker comes first (link(2) fails if it exists)."""
    path = root / "store-id"
    if not path.exists():
        root.mkdir(parents=True, exist_ok=True)
        temp = root / f"{TEMP_PREFIX}{socket.gethostname()}-{os.getpid()}-id"
        temp.write_text(uuid.uuid4().hex + "\n")
        try:
            os.link(temp, path)
        except FileExistsError:
            pass
        finally:
            temp.unlink(missing_ok=True)
    return path.read_text().strip()


def block_files(root: Path) -> Iterator[os.DirEntry]:
    """Every block file and temporary file under a store folder."""
    for fp_dir in _subdirs(root):
        for shard in _subdirs(Path(fp_dir.path)):
            try:
                with os.scandir(shard.path) as entries:
                    yield from (e for e in entries if e.name.endswith(SUFFIX) or e.name.startswith(TEMP_PREFIX))
            except FileNotFoundError:  # cleared meanwhile
                continue


def _subdirs(path: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as entries:
            return [e for e in entries if e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return []


class DiskTier:
    """Blocks of one fingerprint in a folder that other workers may share."""

    def __init__(self, root: str | os.PathLike, fingerprint: Fingerprint, max_bytes: int) -> None:
        self.root = Path(root)
        self.fingerprint = fingerprint.digest()
        self.folder = self.root / fingerprint.hex
        self.folder.mkdir(parents=True, exist_ok=True)
        self.store_id = store_id(self.root)
        self.description = f"folder {self.root}"
        self.max_bytes = max_bytes
        self._usage = TierUsage()
        self._written_since_scan = 0
        self._scanned = False
        meta = self.folder / "fingerprint.json"
        if not meta.exists():
            self._replace(meta, [json.dumps(fingerprint.describe(), indent=2).encode()])

    def path(self, key: bytes) -> Path:
        name = key.hex()
        return self.folder / name[:2] / f"{name}{SUFFIX}"

    # ---- reads ---------------------------------------------------------------------------------

    def count_run(self, blocks: Sequence[Block]) -> int:
        for index, block in enumerate(blocks):
            if not self.path(block.key).is_file():
                return index
        return len(blocks)

    def read_run(self, blocks: Sequence[Block], slot: Callable[[int], memoryview]) -> int:
        for index, block in enumerate(blocks):
            if not self._read(block, slot(index)):
                return index
        return len(blocks)

    def _read(self, block: Block, into: memoryview) -> bool:
        path = self.path(block.key)
        start = record.record_bytes(block.tokens)
        try:
            with open(path, "rb", buffering=0) as f:
                head = f.read(start)
                crc = record.check_header(head, self.fingerprint, block.key, block.tokens, into.nbytes)
                got = f.readinto(into) if crc is not None else 0
                whole = crc is not None and got == into.nbytes and not f.read(1)
                if not whole or record.checksum([block.tokens, into]) != crc:
                    self._discard(path, os.fstat(f.fileno()))
                    return False
                stat = os.fstat(f.fileno())
        except FileNotFoundError:
            return False
        except OSError as exc:
            log.warning("KV store: could not read %s: %s", path, exc)
            return False
        if time.time() - stat.st_mtime > TOUCH_AFTER_S:
            self._touch(path)
        return True

    def _discard(self, path: Path, stat: os.stat_result) -> None:
        """A record that failed its checks: delete it, unless another worker replaced it meanwhile."""
        log.warning("KV store: %s is damaged or truncated; ignored and removed", path)
        try:
            if os.stat(path).st_ino == stat.st_ino:
                path.unlink()
        except OSError:
            pass

    def _touch(self, path: Path, when: float | None = None) -> None:
        try:
            os.utime(path, None if when is None else (when, when))
        except OSError:  # evicted meanwhile: it was read already
            pass

    # ---- writes --------------------------------------------------------------------------------

    def ensure(self, block: Block, payload: Sequence[Buffer]) -> int:
        path = self.path(block.key)
        try:
            mtime = path.stat().st_mtime
            if block.keep_until > mtime:
                self._touch(path, block.keep_until)
            elif time.time() - mtime > TOUCH_AFTER_S:
                self._touch(path)
            return 0
        except FileNotFoundError:
            pass
        parts = [record.header(self.fingerprint, block.key, block.tokens, payload), *payload]
        written = self._replace(path, parts)
        if block.keep_until:
            self._touch(path, block.keep_until)
        self._written_since_scan += written
        self._usage.size_bytes += written
        return written

    def _replace(self, path: Path, parts: Sequence[Buffer]) -> int:
        """Write ``parts`` to a temporary file beside ``path``, then rename it into place."""
        temp = path.with_name(f"{TEMP_PREFIX}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            f = open(temp, "wb")
        except FileNotFoundError:  # the shard folder is new (or was cleared)
            path.parent.mkdir(parents=True, exist_ok=True)
            f = open(temp, "wb")
        try:
            with f:
                written = sum(f.write(part) for part in parts)
            os.replace(temp, path)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        return written

    # ---- the size bound ------------------------------------------------------------------------

    @property
    def usage(self) -> TierUsage:
        return self._usage

    def maintain(self) -> None:
        if self._scanned and self._written_since_scan < RESCAN_SHARE * self.max_bytes:
            return
        self._scanned, self._written_since_scan = True, 0
        with self._evict_lock() as mine:
            files = self._scan()
            total = sum(size for _, size, _ in files)
            if mine and total > self.max_bytes:
                total -= self._evict(files, total)
        self._usage.size_bytes = total

    def _scan(self) -> list[tuple[float, int, str]]:
        """(modification time, size, path) of every block file; old temporary files are removed."""
        now = time.time()
        files = []
        for entry in block_files(self.root):
            try:
                stat = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if entry.name.startswith(TEMP_PREFIX):
                if now - stat.st_mtime > TEMP_MAX_AGE_S:
                    Path(entry.path).unlink(missing_ok=True)
                continue
            files.append((stat.st_mtime, stat.st_size, entry.path))
        return files

    def _evict(self, files: list[tuple[float, int, str]], total: int) -> int:
        """Delete the least recently used files until the folder is under EVICT_TO of the bound."""
        freed = 0
        for _, size, path in sorted(files):
            if total - freed <= EVICT_TO * self.max_bytes:
                break
            try:
                os.unlink(path)
                freed += size
                self._usage.evictions += 1
            except FileNotFoundError:  # another worker's eviction, or a clear
                freed += size
        log.info(
            "KV store: evicted %.1f MB of least recently used blocks (bound %.1f MB)", freed / 1e6, self.max_bytes / 1e6
        )
        return freed

    def _evict_lock(self) -> _Lock:
        return _Lock(self.root / ".evict.lock")


class _Lock:
    """A non-blocking exclusive lock on a file; ``with`` gives whether this process holds it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: int | None = None

    def __enter__(self) -> bool:
        if fcntl is None:
            return True
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError:
            return False

    def __exit__(self, *_: object) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing releases the lock
