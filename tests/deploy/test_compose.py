"""compose.yaml has the fleet's shape: two gateways sharing one PostgreSQL state store, every worker
connected to both, two model names, and a `worker` service that `--scale worker=N` can multiply. (Running its commands as processes is
tests/integration/test_processes.py; `docker-compose config` validation is there too.)"""

from __future__ import annotations

from urllib.parse import urlsplit

import yaml

from gateway.config import ALL_GATEWAY_FLAGS
from tests.conftest import REPO
from worker.config import ALL_WORKER_FLAGS

SERVICES = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]
GATEWAYS = sorted(name for name in SERVICES if name.startswith("gateway"))
WORKERS = sorted(name for name in SERVICES if name.startswith("worker"))


def test_every_worker_connects_to_every_gateway():
    assert GATEWAYS == ["gateway-a", "gateway-b"]
    for name in WORKERS:
        addresses = SERVICES[name]["environment"]["LLMPOOL_GATEWAY_ADDRESS"].split(",")
        assert addresses == [f"tcp://{gateway}:5555" for gateway in GATEWAYS]
    for gateway in GATEWAYS:
        assert SERVICES[gateway]["environment"]["LLMPOOL_ZMQ_BIND"] == "tcp://0.0.0.0:5555"


def test_gateways_publish_distinct_ports():
    published = [port.split(":")[0] for gateway in GATEWAYS for port in SERVICES[gateway]["ports"]]
    assert sorted(published) == ["8000", "8001"]


def test_the_worker_service_scales():
    """`--scale worker=N` needs no fixed container name and no published host port."""
    for name in WORKERS:
        assert "container_name" not in SERVICES[name] and "ports" not in SERVICES[name]
    served = [
        SERVICES[n]["environment"].get("LLMPOOL_SERVED_MODEL_NAME", SERVICES[n]["environment"]["LLMPOOL_MODEL"])
        for n in WORKERS
    ]
    assert len(set(served)) == 2


def test_env_names_are_flag_twins():
    flags = {"gateway": {f.env for f in ALL_GATEWAY_FLAGS}, "worker": {f.env for f in ALL_WORKER_FLAGS}}
    for name, service in SERVICES.items():
        if name == "postgres":
            continue
        component = service["command"][1]
        assert not set(service["environment"]) - flags[component], name


def test_the_gateways_share_the_postgres_service():
    """Both gateways name the postgres service with its own user, password and database, and wait for it."""
    postgres = SERVICES["postgres"]
    assert postgres["image"].startswith("postgres:") and "pgdata" in postgres["volumes"][0]
    assert "pg_isready" in " ".join(postgres["healthcheck"]["test"])
    env = postgres["environment"]
    urls = {SERVICES[g]["environment"]["LLMPOOL_STATE_URL"] for g in GATEWAYS}
    (url,) = urls  # one store for the fleet
    parts = urlsplit(url)
    assert parts.scheme == "postgresql" and parts.hostname == "postgres" and parts.port == 5432
    assert (parts.username, parts.password, parts.path.lstrip("/")) == (
        env["POSTGRES_USER"],
        env["POSTGRES_PASSWORD"],
        env["POSTGRES_DB"],
    )
    for gateway in GATEWAYS:
        assert SERVICES[gateway]["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    for worker in WORKERS:
        assert "LLMPOOL_STATE_URL" not in SERVICES[worker]["environment"], "workers keep no state"
