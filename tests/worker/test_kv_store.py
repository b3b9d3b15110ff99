"""The KV store's parts without a model: the folder tier (checks, atomic writes, the size bound, many
processes at once) and the engine's link (lookups, loads counted as computed, write-behind), with a
fake runner whose blocks are bytes."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from common.protocol import NewRequest, SamplingParams
from tests.conftest import REPO
from tests.worker.fake_runner import FakeRunner
from worker.config import WorkerConfig
from worker.engine import Engine
from worker.kv_store import Fingerprint, KVStore, admin
from worker.kv_store.disk import DiskTier
from worker.kv_store.record import chain_keys, token_bytes
from worker.kv_store.tier import Block

BLOCK = 4
PAYLOAD = 64


def fingerprint(**changes: object) -> Fingerprint:
    fields = {
        "model": "m",
        "weights": "w",
        "config": "c",
        "dtype": "float32",
        "layout": "l",
        "block_size": BLOCK,
        "quantization": "none",
    }
    return Fingerprint(**{**fields, **changes})


def blocks_of(tokens: list[int], fp: Fingerprint | None = None) -> list[Block]:
    fp = fp or fingerprint()
    n = len(tokens) // BLOCK
    keys = chain_keys(fp.digest(), tokens, BLOCK, n)
    return [Block(k, token_bytes(tokens[i * BLOCK : (i + 1) * BLOCK])) for i, k in enumerate(keys)]


def payload(block: Block) -> bytes:
    return (block.key * (PAYLOAD // len(block.key) + 1))[:PAYLOAD]


def read_all(tier: DiskTier, blocks: list[Block]) -> tuple[int, list[bytes]]:
    out = [bytearray(PAYLOAD) for _ in blocks]
    found = tier.read_run(blocks, lambda i: memoryview(out[i]))
    return found, [bytes(b) for b in out[:found]]


def test_a_record_reads_back_only_whole_and_for_its_own_fingerprint(tmp_path):
    tier = DiskTier(tmp_path, fingerprint(), 1 << 30)
    blocks = blocks_of(list(range(100, 116)))
    assert [tier.ensure(b, [payload(b)]) > 0 for b in blocks] == [True] * 4
    assert tier.ensure(blocks[0], [payload(blocks[0])]) == 0  # there already
    assert read_all(tier, blocks) == (4, [payload(b) for b in blocks])
    # Another fingerprint (here: another dtype) reads another folder, and never this one's records.
    other = DiskTier(tmp_path, fingerprint(dtype="bfloat16"), 1 << 30)
    assert other.store_id == tier.store_id and other.folder != tier.folder
    assert other.count_run(blocks_of(list(range(100, 116)), fingerprint(dtype="bfloat16"))) == 0
    other.path(blocks[0].key).parent.mkdir(parents=True)
    os.link(tier.path(blocks[0].key), other.path(blocks[0].key))  # even under its key: the header says whose it is
    assert read_all(other, blocks[:1])[0] == 0


@pytest.mark.parametrize("damage", ["truncated", "flipped", "empty"])
def test_a_damaged_record_is_refused_and_removed(tmp_path, damage):
    tier = DiskTier(tmp_path, fingerprint(), 1 << 30)
    blocks = blocks_of(list(range(100, 116)))
    for b in blocks:
        tier.ensure(b, [payload(b)])
    path = tier.path(blocks[2].key)
    data = path.read_bytes()
    path.write_bytes(
        {"truncated": data[:-5], "flipped": data[:-5] + bytes([data[-5] ^ 1]) + data[-4:], "empty": b""}[damage]
    )
    assert read_all(tier, blocks)[0] == 2  # the two before it are good; nothing from the damaged one on
    assert not path.exists()
    assert tier.ensure(blocks[2], [payload(blocks[2])]) > 0  # written again by the next worker that computes it
    assert read_all(tier, blocks)[0] == 4


def test_the_size_bound_evicts_the_least_recently_used(tmp_path):
    tier = DiskTier(tmp_path / "store", fingerprint(), 10 * (PAYLOAD + 100))
    blocks = blocks_of(list(range(100, 160)))  # 15 blocks of ~150 bytes each: over the bound
    now = time.time()
    for i, b in enumerate(blocks):
        tier.ensure(b, [payload(b)])
        os.utime(tier.path(b.key), (now - 1000 + i, now - 1000 + i))  # written in order, a second apart
    os.utime(tier.path(blocks[0].key))  # ... and the first read just now
    tier.maintain()
    present = [tier.path(b.key).exists() for b in blocks]
    assert tier.usage.size_bytes <= 0.9 * tier.max_bytes and tier.usage.evictions == present.count(False)
    assert present[0] and not present[1]  # least recently used first, by time of use, not of writing
    assert present[-1]
    assert tier.usage.size_bytes == sum(tier.path(b.key).stat().st_size for b, p in zip(blocks, present) if p)


WRITER = textwrap.dedent(
    """
    import sys, time
    from worker.kv_store.disk import DiskTier
    from worker.kv_store.fingerprint import Fingerprint
    from worker.kv_store.record import chain_keys, token_bytes
    from worker.kv_store.tier import Block
    fp = Fingerprint("m", "w", "c", "float32", "l", 4, "none")
    tokens = list(range(1000, 1160))
    blocks = [Block(k, token_bytes(tokens[i * 4 : i * 4 + 4])) for i, k in enumerate(chain_keys(fp.digest(), tokens, 4, 40))]
    payload = {b.key: b.key * 4 for b in blocks}
    tier = DiskTier(sys.argv[1], fp, int(sys.argv[2]))
    bad = reads = 0
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        for b in blocks:
            tier.ensure(b, [payload[b.key]])
        tier._written_since_scan = 1 << 40  # scan and evict on every round: files vanish under the readers
        tier.maintain()
        out = [bytearray(64) for _ in blocks]
        found = tier.read_run(blocks, lambda i: memoryview(out[i]))
        reads += found
        bad += sum(bytes(out[i]) != payload[b.key] for i, b in enumerate(blocks[:found]))
    print(reads, bad, tier.usage.evictions)
    """
)


def test_many_processes_share_one_folder(tmp_path):
    """Four processes write the same blocks, read them and evict under each other at once: every
    read is either whole and right or a miss."""
    bound = 25 * (PAYLOAD + 100)  # fewer than the 40 blocks: evictions all the time
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, str(tmp_path), str(bound)], cwd=REPO, stdout=subprocess.PIPE, text=True
        )
        for _ in range(4)
    ]
    results = [[int(n) for n in p.communicate(timeout=60)[0].split()] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sum(reads for reads, _, _ in results) > 0
    assert [bad for _, bad, _ in results] == [0] * 4
    assert sum(evicted for _, _, evicted in results) > 0
    assert not list(tmp_path.rglob(".tmp-*"))  # no temporary file left behind


class BytesIO:
    """The runner's block I/O over plain memory: each block is PAYLOAD bytes."""

    payload_bytes = PAYLOAD

    def __init__(self, num_blocks: int) -> None:
        self.memory = [bytearray(PAYLOAD) for _ in range(num_blocks)]
        self.loaded: list[int] = []

    def block_parts(self, block_id: int) -> list[memoryview]:
        return [memoryview(self.memory[block_id])]

    def copy_in(self, block_ids: list[int], staged: memoryview) -> None:
        for i, block_id in enumerate(block_ids):
            self.memory[block_id][:] = staged[i * PAYLOAD : (i + 1) * PAYLOAD]
        self.loaded += block_ids


def store_engine(folder: Path, num_blocks: int = 64) -> tuple[Engine, FakeRunner, BytesIO]:
    runner, io = FakeRunner(num_blocks=num_blocks), BytesIO(num_blocks)
    link = functools.partial(KVStore, DiskTier(folder, fingerprint(), 1 << 30), io, fingerprint().digest())
    return Engine(runner, WorkerConfig(block_size=BLOCK), link), runner, io


def run(engine: Engine, prompt: list[int], rid: str = "r", retain_s: float = 0.0) -> list[int]:
    """A greedy request to its end, and the store's writes after it; checks that no block leaked."""
    engine.add_request(NewRequest(rid, prompt, 3, SamplingParams(temperature=0), retain_s=retain_s))
    got: list[int] = []
    while engine.has_work():
        for o in engine.step().outputs:
            got += o.new_token_ids
    engine.kv_store.flush()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks, "KV blocks leaked"
    return got


def test_a_restarted_engine_loads_the_prompt_and_computes_only_the_rest(tmp_path):
    prompt = list(range(100, 118))  # 4 full blocks and 2 tokens
    first, runner, io = store_engine(tmp_path)
    for block_id in range(first.blocks.num_blocks):
        io.memory[block_id][:] = bytes([block_id]) * PAYLOAD  # each block's "cache" says which block it was
    assert run(first, prompt) == [118, 119, 120]
    assert first.load().kv_store_written_bytes > 0 and first.load().kv_store_hits == 0
    written = [bytes(io.memory[i]) for i in range(4)]  # the prompt's blocks were the first 4

    second, runner2, io2 = store_engine(tmp_path)
    assert run(second, prompt) == [118, 119, 120]
    load = second.load()
    assert (load.kv_store_hits, load.kv_store_misses) == (4, 0)
    assert runner2.batches[0] == [("r", 2)]  # 16 tokens loaded: only the last 2 computed
    assert [bytes(io2.memory[i]) for i in io2.loaded] == written
    assert load.kv_store_id == first.load().kv_store_id
    assert load.kv_store_read_bytes == 4 * PAYLOAD and load.kv_store_written_bytes == 0


def test_prefix_cache_hits_come_first_and_the_store_fills_in_after_them(tmp_path):
    prompt = list(range(100, 118))
    first, _, _ = store_engine(tmp_path)
    run(first, prompt)
    second, runner, io = store_engine(tmp_path)
    run(second, prompt[:9])  # blocks 0-1 (from the store) into its own prefix cache
    before = second.load().kv_store_hits
    hits = second.blocks.hit_tokens
    run(second, prompt, "again")
    assert second.blocks.hit_tokens - hits == 2 * BLOCK
    assert (second.load().kv_store_hits - before, second.load().kv_store_misses) == (2, 0)  # blocks 2-3 only
    assert runner.batches[-3] == [("again", 2)]


def test_a_request_ended_while_its_lookup_reads_leaks_nothing(tmp_path):
    prompt = list(range(100, 140))
    first, _, _ = store_engine(tmp_path)
    run(first, prompt)
    second, _, _ = store_engine(tmp_path)
    gate = threading.Event()
    tier = second.kv_store.tier
    read_run = tier.read_run
    tier.read_run = lambda *args: gate.wait() and read_run(*args)
    second.add_request(NewRequest("gone", prompt, 3, SamplingParams(temperature=0)))
    second.abort(["gone"])
    gate.set()
    second.kv_store.flush()
    assert second.kv_store._staged == 0 and not second.has_work()
    assert second.blocks.num_free_blocks == second.blocks.num_blocks


def test_an_unreachable_redis_is_a_clear_error_at_start():
    from tests.conftest import free_port
    from worker.kv_store import open_tier

    with pytest.raises(ValueError, match=r"--kv-store redis 127.0.0.1:\d+/0: ConnectionError"):
        open_tier(f"redis://user:secret@127.0.0.1:{free_port()}/0", fingerprint(), 1)


def test_retained_blocks_outlast_unretained_ones_in_redis_until_their_ttl(redis_url):
    """Each key expires its idle time after its last use or its retention's end; a plain use never
    shortens a retention; and under a memory bound (volatile-ttl, as the fixture's server runs) the
    server evicts unretained blocks, keeping the retained ones."""
    import redis

    from worker.kv_store import open_tier
    from worker.kv_store.redis_tier import IDLE_S

    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    tier = open_tier(redis_url, fingerprint(), 1)
    kept, plain = blocks_of(list(range(100, 116))), blocks_of(list(range(200, 216)))
    now = time.time()
    for block in kept:
        block.keep_until = now + 3600
        assert tier.ensure(block, [payload(block)]) > 0
    for block in plain:
        assert tier.ensure(block, [payload(block)]) > 0

    def ends(blocks: list[Block]) -> list[float]:
        return [client.pexpiretime(tier._key(b)) / 1000 - IDLE_S for b in blocks]

    assert all(now + 3599 <= end <= time.time() + 3600 for end in ends(kept))
    assert all(now - 1 <= end <= time.time() for end in ends(plain))
    kept[0].keep_until = 0.0
    assert tier.ensure(kept[0], [payload(kept[0])]) == 0  # there already: a plain use of a retained block ...
    assert ends(kept[:1])[0] >= now + 3599  # ... keeps its retention

    big = bytes(16 << 10)
    config = client.config_get("maxmemory")
    client.config_set("maxmemory", client.info("memory")["used_memory"] + (256 << 10))
    try:
        fillers = blocks_of(list(range(1000, 1000 + 4 * 48)))
        for block in fillers:  # 768 KiB of plain blocks into 256 KiB of room
            tier.ensure(block, [big])
        assert client.info("stats")["evicted_keys"] > 0
        assert all(client.exists(tier._key(b)) for b in kept)
    finally:
        client.config_set("maxmemory", config["maxmemory"])
        client.flushdb()


def test_admin_stats_and_clear(tmp_path):
    first, _, _ = store_engine(tmp_path)
    run(first, list(range(100, 118)))
    found = admin.stats(str(tmp_path))
    assert found["blocks"] == 4 and found["bytes"] > 4 * PAYLOAD
    (only,) = found["fingerprints"].values()
    assert only["fingerprint"]["dtype"] == "float32" and only["blocks"] == 4
    assert admin.clear(str(tmp_path)) == 4
    assert admin.stats(str(tmp_path))["blocks"] == 0
    with pytest.raises(SystemExit, match="not a KV store"):
        admin.clear(str(tmp_path / "fingerprint-less"))


def test_retained_blocks_outlast_unretained_ones_in_the_folder_until_their_ttl(tmp_path):
    engine, _, _ = store_engine(tmp_path)
    tier = engine.kv_store.tier
    kept, plain = list(range(100, 117)), list(range(200, 217))  # 4 full blocks each
    before = time.time()
    run(engine, kept, "kept", retain_s=3600.0)  # cache_control ttl 1h
    run(engine, plain, "plain")
    ends = [tier.path(b.key).stat().st_mtime for b in blocks_of(kept[:16])]
    assert all(before + 3600 <= end <= time.time() + 3600 for end in ends)  # kept until the hour is over
    assert all(tier.path(b.key).stat().st_mtime <= time.time() for b in blocks_of(plain[:16]))

    run(engine, kept, "again", retain_s=7200.0)  # a later retaining request renews it, though it is stored
    assert all(tier.path(b.key).stat().st_mtime >= before + 7200 for b in blocks_of(kept[:16]))
    one = tier.path(blocks_of(kept[:4])[0].key).stat().st_size
    tier.max_bytes, tier._scanned = 5 * one, False  # room for 4 of the 8 blocks (the bound's 90 %)
    tier.maintain()
    assert [tier.path(b.key).exists() for b in blocks_of(kept[:16]) + blocks_of(plain[:16])] == [True] * 4 + [False] * 4
