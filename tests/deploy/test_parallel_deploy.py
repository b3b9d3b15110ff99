"""The tensor-parallel deployments, validated offline: the LeaderWorkerSet (a group of pods per
replica, restarted whole) and compose.tp.yaml (two ranks in two containers). Each pod template
passes the Kubernetes Pod schema, its environment names are real flags, its command parses once
Kubernetes has expanded LWS's variables, and the ranks it gives each pod are the group's."""

from __future__ import annotations

import os
from typing import Any

import kubernetes_validate
import pytest
import yaml

from common.config import from_namespace
from tests.conftest import REPO
from worker.__main__ import build_parser
from worker.config import ALL_WORKER_FLAGS, WorkerConfig
from worker.parallel.topology import resolve

LWS = yaml.safe_load((REPO / "deploy" / "kubernetes" / "leaderworkerset" / "worker-lws.yaml").read_text())
COMPOSE = yaml.safe_load((REPO / "compose.tp.yaml").read_text())["services"]
BASE_COMPOSE = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]
TWINS = {flag.env for flag in ALL_WORKER_FLAGS}


def parsed(command: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> WorkerConfig:
    """The worker's settings from a container's command and environment."""
    assert command[:2] == ["llmpool", "worker"]
    for name in [n for n in os.environ if n.startswith("LLMPOOL_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return from_namespace(WorkerConfig, build_parser().parse_args(command[2:]))


def lws_env(template: dict[str, Any]) -> dict[str, str]:
    (container,) = template["spec"]["containers"]
    return {e["name"]: e.get("value", "from-the-pod") for e in container["env"]}


def expand(command: list[str], index: int) -> list[str]:
    """Kubernetes' $(VAR) expansion of the variables LWS sets in a group's pod ``index``."""
    values = {"$(LWS_LEADER_ADDRESS)": "llmpool-worker-tp-0.llmpool-worker-tp", "$(LWS_WORKER_INDEX)": str(index)}
    return [values.get(part, part) for part in command]


def test_a_group_is_its_nodes_and_restarts_whole():
    spec = LWS["spec"]["leaderWorkerTemplate"]
    assert LWS["apiVersion"] == "leaderworkerset.x-k8s.io/v1" and LWS["kind"] == "LeaderWorkerSet"
    assert spec["restartPolicy"] == "RecreateGroupOnPodRestart"
    for template in (spec["leaderTemplate"], spec["workerTemplate"]):
        assert int(lws_env(template)["LLMPOOL_NNODES"]) == spec["size"]


@pytest.mark.parametrize("role", ["leaderTemplate", "workerTemplate"])
def test_each_pod_template_passes_the_pod_schema_with_flag_twins_only(role):
    template = LWS["spec"]["leaderWorkerTemplate"][role]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "x", **template["metadata"]},
        "spec": template["spec"],
    }
    kubernetes_validate.validate(pod, kubernetes_validate.latest_version(), strict=True)
    assert set(lws_env(template)) <= TWINS


def test_the_leader_holds_rank_0_and_every_other_pod_a_headless_share(monkeypatch):
    spec = LWS["spec"]["leaderWorkerTemplate"]
    per_node = []
    for index in range(spec["size"]):
        template = spec["leaderTemplate" if index == 0 else "workerTemplate"]
        (container,) = template["spec"]["containers"]
        config = parsed(expand(container["command"], index), lws_env(template), monkeypatch)
        topology = resolve(config, {})
        assert config.headless == (index > 0) and topology.master_addr.startswith("llmpool-worker-tp-0")
        per_node.append((topology.rank, topology.local_world))
    gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
    assert per_node == [(index * gpus, gpus) for index in range(spec["size"])]


def test_compose_runs_two_ranks_in_two_containers_of_one_group(monkeypatch):
    assert set(COMPOSE) == {"worker-tp-0", "worker-tp-1"}
    ranks = []
    for name, service in sorted(COMPOSE.items()):
        env = service["environment"]
        assert set(env) <= TWINS and service["command"] == ["llmpool", "worker"]
        topology = resolve(parsed(service["command"], env, monkeypatch), {})
        assert topology.master_addr == "worker-tp-0"  # the first container's service name
        ranks.append((topology.rank, topology.world, topology.local_world))
    assert ranks == [(0, 2, 1), (1, 2, 1)]
    assert set(COMPOSE["worker-tp-0"]["depends_on"]) <= set(BASE_COMPOSE)  # the gateways of compose.yaml
    addresses = COMPOSE["worker-tp-0"]["environment"]["LLMPOOL_GATEWAY_ADDRESS"]
    assert addresses == BASE_COMPOSE["worker"]["environment"]["LLMPOOL_GATEWAY_ADDRESS"]
