"""deploy/kubernetes, validated offline: every overlay renders, every object passes the Kubernetes
schema (kubernetes-validate's bundled schemas), and the wiring holds: probes, the headless ZeroMQ
Service, Secrets, Prometheus annotations, env names that are real flags, commands that parse."""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gateway.config import ALL_GATEWAY_FLAGS
from launcher.cli import LAUNCHER_FLAGS
from launcher.cli import build_parser as launcher_parser
from tests.conftest import REPO
from tests.deploy.kustomize import render
from worker.config import ALL_WORKER_FLAGS

KUBE = REPO / "deploy" / "kubernetes"
OVERLAYS = sorted(p.name for p in (KUBE / "overlays").iterdir())
GATEWAY_ZMQ = "tcp://llmpool-gateway-zmq:5555"
# Environment the worker reads outside its flags: where the C++ kernels are built (worker/kernels).
WORKER_EXTRA_ENV = {"LLMPOOL_KERNEL_DIR"}
FLAG_ENVS = {
    "gateway": {f.env for f in ALL_GATEWAY_FLAGS},
    "worker": {f.env for f in ALL_WORKER_FLAGS} | WORKER_EXTRA_ENV,
}


def objects(overlay: str) -> list[dict[str, Any]]:
    return render(KUBE / "overlays" / overlay)


def find(objs: list[dict], kind: str, name: str) -> dict:
    (obj,) = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj


def workloads(objs: list[dict], component: str) -> list[dict]:
    return [
        o
        for o in objs
        if o["kind"] in ("Deployment", "StatefulSet")
        and o["metadata"]["labels"]["app.kubernetes.io/component"] == component
    ]


def container(workload: dict) -> dict:
    (only,) = workload["spec"]["template"]["spec"]["containers"]
    return only


def env(workload: dict) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(workload)["env"]}


def test_overlays_exist():
    assert OVERLAYS == ["cpu", "gpu", "kv-store-shared", "multi-model"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_passes_the_schema(overlay):
    version = kubernetes_validate.latest_version()
    for obj in objects(overlay):
        kubernetes_validate.validate(obj, version, strict=True)  # raises ValidationError


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_renderer_matches_kubectl_kustomize(overlay):
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed: the manifests are checked with the built-in renderer alone")
    result = subprocess.run(
        ["kubectl", "kustomize", str(KUBE / "overlays" / overlay)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    theirs = {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(result.stdout) if o}
    ours = {(o["kind"], o["metadata"]["name"]): o for o in objects(overlay)}
    assert ours == theirs


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gateway_probes_and_metrics(overlay):
    (gateway,) = workloads(objects(overlay), "gateway")
    c = container(gateway)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": 8000, "zmq": 5555}
    assert env(gateway)["LLMPOOL_PORT"] == "8000" and env(gateway)["LLMPOOL_ZMQ_BIND"] == "tcp://0.0.0.0:5555"
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    probe = readiness_command(gateway)
    assert "/ready" in probe[-1]
    compile(probe[-1], "readinessProbe", "exec")
    annotations = gateway["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": "8000",
        "prometheus.io/path": "/metrics",
    }
    grace = float(env(gateway)["LLMPOOL_SHUTDOWN_GRACE"])
    assert gateway["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > grace


def readiness_command(gateway: dict) -> list[str]:
    return container(gateway)["readinessProbe"]["exec"]["command"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_reach_every_gateway_through_the_headless_service(overlay):
    objs = objects(overlay)
    (gateway,) = workloads(objs, "gateway")
    pod_labels = gateway["spec"]["template"]["metadata"]["labels"]
    zmq = find(objs, "Service", "llmpool-gateway-zmq")
    assert zmq["spec"]["clusterIP"] == "None" and zmq["spec"]["publishNotReadyAddresses"] is True
    assert zmq["spec"]["ports"] == [{"name": "zmq", "port": 5555, "targetPort": "zmq"}]
    http = find(objs, "Service", "llmpool-gateway")
    assert http["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http"}]
    for service in (zmq, http):
        assert service["spec"]["selector"].items() <= pod_labels.items()
    workers = workloads(objs, "worker")
    assert workers
    for worker in workers:
        assert env(worker)["LLMPOOL_GATEWAY_ADDRESS"] == GATEWAY_ZMQ
        assert "ports" not in container(worker), "workers dial out; nothing connects to them"
        assert not (worker["spec"]["template"]["metadata"]["labels"].items() >= http["spec"]["selector"].items()), (
            "a Service would select workers"
        )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_secrets_are_mounted_where_the_flags_point(overlay):
    for workload in workloads(objects(overlay), "gateway") + workloads(objects(overlay), "worker"):
        pod = workload["spec"]["template"]["spec"]
        secrets = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
        mounts = {m["mountPath"]: m["name"] for m in container(workload)["volumeMounts"]}
        curve = {k: v for k, v in env(workload).items() if k.startswith("LLMPOOL_CURVE_")}
        assert len(curve) == 2, "CURVE is on for every gateway and worker"
        for path in curve.values():
            folder = path if path.endswith("authorized") else os.path.dirname(path)
            assert mounts[folder] in secrets, f"{path} is not on a Secret volume"
    (gateway,) = workloads(objects(overlay), "gateway")
    assert env(gateway)["LLMPOOL_API_KEY"] == {"secretKeyRef": {"name": "llmpool-api-keys", "key": "api-key"}}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_keep_models_on_a_volume(overlay):
    for worker in workloads(objects(overlay), "worker"):
        assert worker["kind"] == "StatefulSet"
        claims = {c["metadata"]["name"] for c in worker["spec"]["volumeClaimTemplates"]}
        mounts = {m["name"]: m["mountPath"] for m in container(worker)["volumeMounts"]}
        assert mounts["model-cache"] == env(worker)["LLMPOOL_CACHE_DIR"] and "model-cache" in claims
        # the image's kernels, built for every CPU of its platform, not a build of the node's own
        assert "LLMPOOL_KERNEL_DIR" not in env(worker)
        assert worker["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > float(
            env(worker)["LLMPOOL_DRAIN_TIMEOUT"]
        )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_keep_their_kv_store_on_a_volume(overlay):
    """--kv-store is a folder on a volume mounted in the pod: the worker's own cache volume (a
    restarted pod reads its predecessor's blocks), or a ReadWriteMany claim every worker shares."""
    objs = objects(overlay)
    for worker in workloads(objs, "worker"):
        store = env(worker)["LLMPOOL_KV_STORE"]
        mounts = {m["mountPath"]: m["name"] for m in container(worker)["volumeMounts"]}
        (mount,) = [path for path in mounts if store == path or store.startswith(path + "/")]
        volume = mounts[mount]
        claims = {c["metadata"]["name"]: c["spec"] for c in worker["spec"]["volumeClaimTemplates"]}
        pod_claims = {
            v["name"]: v["persistentVolumeClaim"]["claimName"]
            for v in worker["spec"]["template"]["spec"]["volumes"]
            if "persistentVolumeClaim" in v
        }
        if volume in pod_claims:
            assert find(objs, "PersistentVolumeClaim", pod_claims[volume])["spec"]["accessModes"] == ["ReadWriteMany"]
        else:
            assert volume in claims, f"{store} is on no persistent volume"
        from common.config import parse_size

        assert parse_size(env(worker)["LLMPOOL_KV_STORE_SIZE"]) > 0
    if overlay == "kv-store-shared":
        assert {env(w)["LLMPOOL_KV_STORE"] for w in workloads(objs, "worker")} == {"/kv-store"}


def test_kernel_dir_is_read_by_the_worker():
    assert '"LLMPOOL_KERNEL_DIR"' in (REPO / "worker" / "kernels" / "compile.py").read_text()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_env_names_are_flag_twins(overlay):
    for component in ("gateway", "worker"):
        for workload in workloads(objects(overlay), component):
            unknown = set(env(workload)) - FLAG_ENVS[component]
            assert not unknown, f"{workload['metadata']['name']}: {unknown} are not flags of `llmpool {component}`"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_commands_parse_with_the_manifest_environment(overlay, monkeypatch):
    from gateway.__main__ import build_parser as gateway_parser
    from worker.__main__ import build_parser as worker_parser

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["llmpool"] == "launcher.cli:main"
    parsers = {"gateway": gateway_parser, "worker": worker_parser}
    for component in ("gateway", "worker"):
        for workload in workloads(objects(overlay), component):
            command = container(workload)["command"]
            assert command[:2] == ["llmpool", component]
            assert launcher_parser().parse_args(command[1:2]).command == component
            for name, value in env(workload).items():
                monkeypatch.setenv(name, value if isinstance(value, str) else "from-a-secret-or-the-pod")
            parsers[component]().parse_args(command[2:])  # typed env values (ints, floats) parse too
            for name in env(workload):
                monkeypatch.delenv(name)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_gateways_share_one_postgres_through_its_service(overlay):
    """Every gateway replica reads the state store's URL from the Secret make-secrets.sh writes; the
    URL names the llmpool-postgres Service, which selects the Postgres pod (its own volume, probes)."""
    objs = objects(overlay)
    (gateway,) = workloads(objs, "gateway")
    assert gateway["spec"]["replicas"] >= 2
    assert env(gateway)["LLMPOOL_STATE_URL"] == {"secretKeyRef": {"name": "llmpool-postgres", "key": "url"}}
    (postgres,) = workloads(objs, "postgres")
    service = find(objs, "Service", "llmpool-postgres")
    assert service["spec"]["selector"].items() <= postgres["spec"]["template"]["metadata"]["labels"].items()
    assert service["spec"]["ports"] == [{"name": "postgres", "port": 5432, "targetPort": "postgres"}]
    c = container(postgres)
    assert c["image"].startswith("postgres:") and {p["name"]: p["containerPort"] for p in c["ports"]} == {
        "postgres": 5432
    }
    assert env(postgres)["POSTGRES_PASSWORD"] == {"secretKeyRef": {"name": "llmpool-postgres", "key": "password"}}
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert (
        env(postgres)["PGDATA"].startswith(mounts["data"] + "/")
        and postgres["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    )
    assert "pg_isready" in c["readinessProbe"]["exec"]["command"]
    script = (KUBE / "make-secrets.sh").read_text()
    assert "secret llmpool-postgres" in script and "@llmpool-postgres:5432/" + env(postgres)["POSTGRES_DB"] in script
    assert f"postgresql://{env(postgres)['POSTGRES_USER']}:" in script


def test_make_secrets_writes_a_state_url_the_gateway_accepts(tmp_path):
    if shutil.which("kubectl") is None:
        pytest.skip("make-secrets.sh needs kubectl (client side only)")
    from urllib.parse import urlsplit

    secrets = make_secrets(tmp_path)["llmpool-postgres"]
    url = urlsplit(secrets["url"].decode())
    assert (
        url.scheme == "postgresql"
        and url.hostname == "llmpool-postgres"
        and url.password == secrets["password"].decode()
    )


def test_launcher_flags_stay_out_of_the_manifests():
    """`serve`'s own flags (--workers, --kill-after) mean nothing to `llmpool gateway|worker`."""
    launcher_envs = {f.env for f in LAUNCHER_FLAGS}
    for overlay in OVERLAYS:
        for workload in workloads(objects(overlay), "gateway") + workloads(objects(overlay), "worker"):
            assert not launcher_envs & set(env(workload))


def test_gpu_overlay_requests_a_gpu_for_workers_only():
    objs = objects("gpu")
    (worker,) = workloads(objs, "worker")
    c = container(worker)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert env(worker)["LLMPOOL_DEVICE"] == "cuda"
    assert c["image"].endswith(":cuda")
    pod = worker["spec"]["template"]["spec"]
    assert pod["nodeSelector"] and any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    assert list(env(worker)).count("LLMPOOL_KV_CACHE_MEMORY") == 1 and env(worker)["LLMPOOL_KV_CACHE_MEMORY"] == "0.85"
    (gateway,) = workloads(objs, "gateway")
    assert "nvidia.com/gpu" not in str(gateway) and container(gateway)["image"].endswith(":cpu")


def test_cpu_overlay_has_no_gpu():
    assert "nvidia.com/gpu" not in str(objects("cpu"))
    assert all(container(w)["image"].endswith(":cpu") for w in workloads(objects("cpu"), "worker"))


def test_multi_model_overlay_serves_two_names_from_separate_workers():
    workers = workloads(objects("multi-model"), "worker")
    names = [env(w)["LLMPOOL_SERVED_MODEL_NAME"] for w in workers]
    assert len(names) == 2 and len(set(names)) == 2
    selectors = [w["spec"]["selector"]["matchLabels"] for w in workers]
    for i, worker in enumerate(workers):
        other = selectors[1 - i]
        assert not worker["spec"]["template"]["metadata"]["labels"].items() >= other.items(), "selectors overlap"
        assert container(worker)["image"].endswith(":cpu")


def make_secrets(tmp_path: Path) -> dict[str, dict[str, bytes]]:
    environment = {
        **os.environ,
        "DRY_RUN": "1",
        "LLMPOOL": f"{sys.executable} -m launcher",
        "LLMPOOL_API_KEY": "k1,k2",
        "TMPDIR": str(tmp_path),
    }
    result = subprocess.run(
        [str(KUBE / "make-secrets.sh")], cwd=REPO, env=environment, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    return {d["metadata"]["name"]: {k: base64.b64decode(v) for k, v in d["data"].items()} for d in docs}


def test_make_secrets_provides_every_secret_the_manifests_mount(tmp_path):
    if shutil.which("kubectl") is None:
        pytest.skip("make-secrets.sh needs kubectl (client side only)")
    import zmq.auth

    secrets = make_secrets(tmp_path)
    assert secrets["llmpool-api-keys"] == {"api-key": b"k1,k2"}
    for overlay in OVERLAYS:
        for workload in workloads(objects(overlay), "gateway") + workloads(objects(overlay), "worker"):
            pod = workload["spec"]["template"]["spec"]
            volumes = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
            mounts = {m["mountPath"]: volumes.get(m["name"]) for m in container(workload)["volumeMounts"]}
            for name, path in env(workload).items():
                if name.startswith("LLMPOOL_CURVE_") and not path.endswith("authorized"):
                    assert os.path.basename(path) in secrets[mounts[os.path.dirname(path)]], path
    # The keys fit together: the gateway accepts the workers' key, the workers trust the gateway's.
    files = tmp_path / "files"
    files.mkdir()
    for secret, entries in secrets.items():
        for key, data in entries.items():
            (files / f"{secret}.{key}").write_bytes(data)
    gateway_public, gateway_secret = zmq.auth.load_certificate(files / "llmpool-curve-gateway.gateway.key_secret")
    assert gateway_secret and zmq.auth.load_certificate(files / "llmpool-curve-worker.gateway.key") == (
        gateway_public,
        None,
    )
    worker_public, worker_secret = zmq.auth.load_certificate(files / "llmpool-curve-worker.worker.key_secret")
    (authorized,) = [k for k in secrets["llmpool-curve-authorized"]]
    assert (
        worker_secret
        and zmq.auth.load_certificate(files / f"llmpool-curve-authorized.{authorized}")[0] == worker_public
    )


def test_readiness_probe_command_against_a_real_gateway(keyed_server):
    """The exec probe, as the manifest has it, run next to a real gateway with API keys (the
    session's keyed server: ``key-one,key-two``)."""
    (gateway,) = workloads(objects("cpu"), "gateway")
    command = readiness_command(gateway)
    assert command[0] == "python"

    def probe(key: str) -> int:
        environment = {**os.environ, "LLMPOOL_PORT": str(keyed_server.port), "LLMPOOL_API_KEY": key}
        return subprocess.run(
            ["python3" if shutil.which("python") is None else "python", *command[1:]],
            env=environment,
            capture_output=True,
            timeout=30,
        ).returncode

    assert probe("key-one,key-two") == 0
    assert probe("wrong") != 0  # 401: a probe that cannot authenticate never reports ready
    import httpx

    assert httpx.get(keyed_server.base_url + "/health", timeout=10).status_code == 200  # liveness needs no key
