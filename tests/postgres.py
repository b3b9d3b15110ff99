"""A real PostgreSQL server for the tests, from Debian's packages, run as a process: initdb into a
temporary folder, then the server on a free loopback port (as the ``postgres`` user when the tests
run as root, since the server refuses root). ``scripts/setup.sh --test`` installs the package."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from tests.conftest import free_port

USER = "llmpool"


def binaries() -> Path | None:
    """The folder of initdb and pg_ctl (Debian keeps them off PATH, under /usr/lib/postgresql/N/bin)."""
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda p: int(p.split("/")[4]) if p.split("/")[4].isdigit() else 0,
    )
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).resolve().parent if initdb else None


class Postgres:
    """One server; ``database(name)`` makes a fresh database on it and gives its URL."""

    def __init__(self, durable: bool = False) -> None:
        bin_dir = binaries()
        if bin_dir is None:
            raise FileNotFoundError(
                "PostgreSQL is not installed (apt-get install postgresql; scripts/setup.sh --test does it)"
            )
        self.folder = Path(tempfile.mkdtemp(prefix="llmpool-pg-"))
        self.port = free_port()
        self.as_root = os.geteuid() == 0
        if self.as_root:
            shutil.chown(self.folder, "postgres", "postgres")
        data = self.folder / "data"
        self._run([str(bin_dir / "initdb"), "-D", str(data), "-U", USER, "--auth=trust", "-E", "UTF8", "--no-sync"])
        options = f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 -c max_connections=200"
        if not durable:  # a test server: nothing needs to survive a power cut
            options += " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        self.pg_ctl = str(bin_dir / "pg_ctl")
        self._run(
            [
                self.pg_ctl,
                "-D",
                str(data),
                "-o",
                options,
                "-l",
                str(self.folder / "server.log"),
                "-w",
                "-t",
                "60",
                "start",
            ]
        )
        self.data = data

    def _run(self, command: list[str]) -> None:
        if self.as_root:
            command = ["runuser", "-u", "postgres", "--", *command]
        result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=self.folder)
        if result.returncode != 0:
            raise RuntimeError(f"{command[0]} failed: {result.stdout}\n{result.stderr}")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{USER}@127.0.0.1:{self.port}/{database}"

    def database(self, name: str) -> str:
        """A new, empty database (dropped first if a test made it before)."""
        import asyncio

        import asyncpg

        async def create() -> None:
            connection = await asyncpg.connect(self.url())
            try:
                await connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
                await connection.execute(f'CREATE DATABASE "{name}"')
            finally:
                await connection.close()

        asyncio.run(create())
        return self.url(name)

    def stop(self) -> None:
        try:
            self._run([self.pg_ctl, "-D", str(self.data), "-m", "immediate", "-w", "stop"])
        except (RuntimeError, subprocess.TimeoutExpired):
            pass
        for _ in range(20):
            try:
                shutil.rmtree(self.folder)
                return
            except OSError:
                time.sleep(0.1)
