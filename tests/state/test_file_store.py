"""Files' bytes outside the database (``--files-url``): a directory and a real S3-compatible server
(moto's, a process). Two gateways (two connections, two stores opened on the same place) run one
batch: the one that ends it writes the output file to the store and the other reads it; a delete
removes the bytes; a file stored in the database before the flag was set stays readable."""

from __future__ import annotations

import os

import msgspec
import pytest

from gateway.state.batches import Batches
from gateway.state.db import connect
from gateway.state.file_store import ContentUnavailable, check_files_url, open_file_store
from gateway.state.files import Files
from gateway.state.leases import Leases
from gateway.state.migrations import migrate
from tests.state.test_batches import ENDPOINT, _open, closing, started
from tests.state.test_store import run


@pytest.fixture(params=["directory", "s3"])
def files_url(request, tmp_path, monkeypatch) -> tuple[str, str | None]:
    """(--files-url, --files-s3-endpoint), each test's own place."""
    if request.param == "directory":
        return f"file://{tmp_path}/files", None
    s3 = request.getfixturevalue("s3")
    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    return f"s3://{s3.bucket}/{request.node.name}", s3.endpoint


async def gateway(state_url: str, name: str, files_url: tuple[str, str | None] | None) -> tuple[Batches, Files]:
    db = await connect(state_url)
    _open.append(db)
    await migrate(db)
    files = Files(db, await open_file_store(*files_url) if files_url else None)
    await Leases(db, name, lease_s=5.0).renew()
    return Batches(db, files, name), files


def stored_ids(files_url: tuple[str, str | None], request) -> set[str]:
    """The file ids whose bytes are in the store, read around the code under test."""
    url, _ = files_url
    if url.startswith("file://"):
        return {name for name in os.listdir(url[len("file://") :]) if not name.startswith(".")}
    s3 = request.getfixturevalue("s3")
    return {key.rsplit("/", 1)[1] for key in s3.keys(request.node.name + "/")}


def test_two_gateways_share_files_and_batch_outputs_through_the_store(tmp_path, files_url, request):
    state_url = f"sqlite:///{tmp_path}/state.db"

    async def scenario():
        (a, files_a), (b, files_b) = (
            await gateway(state_url, "ga", files_url),
            await gateway(state_url, "gb", files_url),
        )
        batch_id = await started(a, files_a, 3)
        (upload,) = stored_ids(files_url, request)
        row = await a.db.fetchone("SELECT bytes, content FROM files WHERE id = ?", upload)
        assert row[0] > 0 and bytes(row[1]) == b"", "the bytes are in the store, not the row"
        for item in await b.claim(batch_id, "k", ENDPOINT, 3):
            assert await b.finish(
                item, msgspec.json.encode({"custom_id": item.custom_id}), item.line == 2, (1, 0, 1, 0)
            )
        assert await b.finalize(batch_id, "completed", 5.0)
        done = await a.get(batch_id, "k")
        output, errors = done["output_file_id"], done["error_file_id"]
        assert stored_ids(files_url, request) == {upload, output, errors}
        assert [msgspec.json.decode(x)["custom_id"] for x in (await files_a.content(output, "k")).splitlines()] == [
            "r0",
            "r1",
        ]
        assert (await files_a.content(errors, "k")).count(b"\n") == 1
        assert not await a.finalize(batch_id, "completed", 5.0), "ended once"
        assert stored_ids(files_url, request) == {upload, output, errors}, "the loser's bytes are gone again"
        assert await files_b.delete(output, "k") and await files_a.content(output, "k") is None
        assert stored_ids(files_url, request) == {upload, errors}
        assert await files_a.get(upload, "someone else") is None and await files_b.content(upload, "nobody") is None

    run(closing(scenario()))


def test_files_from_before_the_flag_stay_readable_and_a_missing_store_is_said(tmp_path, files_url):
    state_url = f"sqlite:///{tmp_path}/state.db"

    async def scenario():
        _, in_rows = await gateway(state_url, "before", None)
        _, in_store = await gateway(state_url, "after", files_url)
        old = await in_rows.create("k", "batch", "old.jsonl", b"kept in the row")
        new = await in_store.create("k", "batch", "new.jsonl", b"kept in the store")
        empty = await in_store.create("k", "batch", "empty.jsonl", b"")
        assert await in_store.content(old["id"], "k") == b"kept in the row"
        assert await in_store.content(new["id"], "k") == b"kept in the store"
        assert await in_store.content(empty["id"], "k") == b""
        with pytest.raises(ContentUnavailable, match="not configured with"):
            await in_rows.content(new["id"], "k")
        await in_store.store.delete(new["id"])  # removed behind the gateway's back
        with pytest.raises(ContentUnavailable, match="missing from"):
            await in_store.content(new["id"], "k")

    run(closing(scenario()))


@pytest.mark.parametrize("url", ["s3:///no-bucket", "file://relative/dir", "http://example/x", "/plain/path"])
def test_a_files_url_of_another_form_is_refused_in_words(url):
    with pytest.raises(ValueError, match="--files-url must be file:///ABSOLUTE/DIR or s3://BUCKET"):
        check_files_url(url)


def test_a_bucket_that_cannot_be_used_is_refused_at_start(s3, monkeypatch):
    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="--files-url s3://no-such-bucket/x: the bucket cannot be used: .*404"):
        run(open_file_store("s3://no-such-bucket/x", s3.endpoint))
