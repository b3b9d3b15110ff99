"""Where a file's bytes live (``--files-url``): in its database row (the default), in a directory,
or in an S3-compatible bucket. The rows (owner, name, size) stay in the state database either way;
only the bytes move, behind three calls by file id: put, get, delete.

A directory or a bucket keeps large files (a 200 MB upload, a batch's output) out of the database,
whose backups and replication then stay small; every gateway that names the same directory (a
shared filesystem) or bucket, and the same database, sees the same files. The bytes are written
before the row and removed after it, so a listed file always has its bytes; a row that never
commits (a write that failed, a batch another gateway ended first) has its bytes removed at once.

S3 goes through boto3, AWS's own client: it reads the standard credentials (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, profiles, instance roles), region and ``AWS_ENDPOINT_URL`` as every AWS
tool does, and speaks to any S3-compatible server. Its calls block, so they run on a thread: a
file is read or written once per upload, batch check and batch end, never per token, and
aiobotocore (the asyncio port) pins one exact botocore release, which fights every other AWS
package in an environment. boto3 is imported only when a bucket is configured.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
from typing import Protocol
from urllib.parse import urlparse

_FILE_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")


class ContentUnavailable(LookupError):
    """A file's row is here but its bytes are not: they live elsewhere, or were removed by hand."""


class FileStore(Protocol):
    """The bytes of files, by file id (the rows stay in the database)."""

    where: str  # for messages: the --files-url it was opened from

    async def put(self, file_id: str, data: bytes) -> None: ...

    async def get(self, file_id: str) -> bytes | None: ...

    async def delete(self, file_id: str) -> None: ...


def _checked(file_id: str) -> str:
    if not _FILE_ID.fullmatch(file_id):  # ids are ours (gateway/state/files.py new_id): never a path
        raise ValueError(f"not a file id: {file_id!r}")
    return file_id


class DirectoryStore:
    """One file per id in a directory; a write lands whole or not at all (a temporary file, renamed)."""

    def __init__(self, path: str, where: str) -> None:
        self.path, self.where = path, where
        os.makedirs(path, exist_ok=True)
        if not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"--files-url {where}: the directory {path} is not writable")

    def _put(self, file_id: str, data: bytes) -> None:
        final = os.path.join(self.path, _checked(file_id))
        temporary = os.path.join(self.path, f".{file_id}.{secrets.token_hex(4)}.tmp")
        try:
            with open(temporary, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temporary, final)
        except BaseException:
            if os.path.exists(temporary):
                os.unlink(temporary)
            raise

    def _get(self, file_id: str) -> bytes | None:
        try:
            with open(os.path.join(self.path, _checked(file_id)), "rb") as source:
                return source.read()
        except FileNotFoundError:
            return None

    async def put(self, file_id: str, data: bytes) -> None:
        await asyncio.to_thread(self._put, file_id, data)

    async def get(self, file_id: str) -> bytes | None:
        return await asyncio.to_thread(self._get, file_id)

    async def delete(self, file_id: str) -> None:
        await asyncio.to_thread(_unlink, os.path.join(self.path, _checked(file_id)))


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class S3Store:
    """One object per id under ``prefix`` in ``bucket``."""

    def __init__(self, bucket: str, prefix: str, endpoint: str | None, where: str) -> None:
        try:
            import boto3
            from botocore.config import Config
        except ImportError as exc:
            raise ValueError(f"--files-url {where} needs boto3: pip install 'llmpool[s3]'") from exc
        self.bucket, self.prefix, self.where = bucket, prefix, where
        config = Config(connect_timeout=5, read_timeout=60, retries={"max_attempts": 4, "mode": "standard"})
        self.client = boto3.client("s3", endpoint_url=endpoint or None, config=config)

    def _key(self, file_id: str) -> str:
        return f"{self.prefix}/{_checked(file_id)}" if self.prefix else _checked(file_id)

    async def check(self) -> None:
        """Fail at start, in words, where the bucket cannot be reached (not at the first upload)."""
        try:
            await asyncio.to_thread(self.client.head_bucket, Bucket=self.bucket)
        except Exception as exc:
            raise ValueError(f"--files-url {self.where}: the bucket cannot be used: {exc}") from exc

    async def put(self, file_id: str, data: bytes) -> None:
        await asyncio.to_thread(self.client.put_object, Bucket=self.bucket, Key=self._key(file_id), Body=data)

    def _get(self, file_id: str) -> bytes | None:
        try:
            answer = self.client.get_object(Bucket=self.bucket, Key=self._key(file_id))
        except self.client.exceptions.NoSuchKey:
            return None
        return answer["Body"].read()

    async def get(self, file_id: str) -> bytes | None:
        return await asyncio.to_thread(self._get, file_id)

    async def delete(self, file_id: str) -> None:
        await asyncio.to_thread(self.client.delete_object, Bucket=self.bucket, Key=self._key(file_id))


def check_files_url(url: str | None) -> None:
    """Refuse a ``--files-url`` of another form before anything starts."""
    if url is None:
        return
    parsed = urlparse(url)
    if parsed.scheme == "file" and parsed.netloc in ("", "localhost") and parsed.path.startswith("/"):
        return
    if parsed.scheme == "s3" and parsed.netloc:
        return
    raise ValueError(
        f"--files-url must be file:///ABSOLUTE/DIR or s3://BUCKET[/PREFIX] (none: in the state database); got {url!r}"
    )


async def open_file_store(url: str | None, s3_endpoint: str | None = None) -> FileStore | None:
    """The store ``--files-url`` names, checked; None: the bytes stay in the database rows."""
    check_files_url(url)
    if url is None:
        return None
    parsed = urlparse(url)
    if parsed.scheme == "file":
        return DirectoryStore(parsed.path, url)
    store = S3Store(parsed.netloc, parsed.path.strip("/"), s3_endpoint, url)
    await store.check()
    return store
