"""The database every state test runs against twice: a SQLite file and a real PostgreSQL server."""

import itertools

import pytest

_names = itertools.count()


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/state.db"
    return request.getfixturevalue("postgres").database(f"store_{next(_names)}")
