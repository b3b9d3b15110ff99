"""``llmpool kv-store stats|clear STORE``: what a KV store holds, and emptying it.

STORE is what workers were given as ``--kv-store``: a folder, or redis://HOST:PORT/DB. Both
commands work while workers use the store: ``clear`` removes blocks (a worker reading one at that
moment just computes it again) and leaves the store's id, so workers keep sharing.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from worker.kv_store.disk import SUFFIX, block_files
from worker.kv_store.redis_tier import PREFIX, connect


def is_redis(store: str) -> bool:
    return store.startswith(("redis://", "rediss://", "unix://"))


def stats(store: str) -> dict:
    """Per fingerprint (model, dtype, layout): blocks, bytes, and how long ago the newest and oldest were used."""
    return _redis_stats(store) if is_redis(store) else _folder_stats(Path(store))


def clear(store: str) -> int:
    """Remove every block (all fingerprints); returns how many."""
    if is_redis(store):
        client = connect(store)
        keys = [k for k in client.scan_iter(match=PREFIX + "*", count=1000) if k != (PREFIX + "store-id").encode()]
        for start in range(0, len(keys), 1000):
            client.unlink(*keys[start : start + 1000])
        return sum(1 for k in keys if k.count(b":") == 3)
    root = _folder(Path(store))
    count = sum(1 for e in block_files(root) if e.name.endswith(SUFFIX))
    for child in root.iterdir():
        if child.is_dir():
            shutil.rmtree(child, ignore_errors=True)
    return count


def _folder(root: Path) -> Path:
    """The store folder, refused when it is not one (``clear`` must never empty some other folder)."""
    if not (root / "store-id").is_file():
        raise SystemExit(f"{root} is not a KV store folder (no store-id file in it)")
    return root


def _folder_stats(root: Path) -> dict:
    now = time.time()
    found: dict[str, dict] = {}
    for entry in block_files(_folder(root)):
        if not entry.name.endswith(SUFFIX):
            continue
        fingerprint = Path(entry.path).parent.parent.name
        stat = entry.stat()
        item = found.setdefault(fingerprint, {"blocks": 0, "bytes": 0, "newest_s": None, "oldest_s": None})
        item["blocks"] += 1
        item["bytes"] += stat.st_size
        age = round(now - stat.st_mtime, 1)
        item["newest_s"] = age if item["newest_s"] is None else min(item["newest_s"], age)
        item["oldest_s"] = age if item["oldest_s"] is None else max(item["oldest_s"], age)
    for fingerprint, item in found.items():
        meta = root / fingerprint / "fingerprint.json"
        item["fingerprint"] = json.loads(meta.read_text()) if meta.is_file() else {}
    return {
        "store": str(root),
        "store_id": (root / "store-id").read_text().strip(),
        "blocks": sum(i["blocks"] for i in found.values()),
        "bytes": sum(i["bytes"] for i in found.values()),
        "fingerprints": found,
    }


def _redis_stats(url: str) -> dict:
    client = connect(url)
    found: dict[str, dict] = {}
    keys = [k.decode() for k in client.scan_iter(match=PREFIX + "*", count=1000)]
    blocks = [k for k in keys if k.count(":") == 3]
    pipe = client.pipeline(transaction=False)
    for key in blocks:
        pipe.strlen(key)
    for key, size in zip(blocks, pipe.execute()):
        item = found.setdefault(key.split(":")[2], {"blocks": 0, "bytes": 0})
        item["blocks"] += 1
        item["bytes"] += size
    for fingerprint, item in found.items():
        meta = client.get(PREFIX + fingerprint)
        item["fingerprint"] = json.loads(meta) if meta else {}
    info = client.info()
    return {
        "store": url.split("@")[-1],
        "store_id": (client.get(PREFIX + "store-id") or b"").decode(),
        "blocks": len(blocks),
        "bytes": sum(i["bytes"] for i in found.values()),
        "used_memory": info.get("used_memory"),
        "maxmemory": info.get("maxmemory"),
        "evicted_keys": info.get("evicted_keys"),
        "fingerprints": found,
    }
