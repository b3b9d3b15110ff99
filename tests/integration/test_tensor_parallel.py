"""``--tensor-parallel-size 2`` and ``--pipeline-parallel-size 2`` on the CPU (gloo), through
``llmpool serve``: every worker is two (or four) real rank processes, and its float32 greedy text is
transformers' ``generate``'s token for token (so a one-rank worker's: tests/worker/test_families.py
holds that one to ``generate`` too), alone and batched, through chunked prefill, a prefix-cache hit
and a preemption. A tiny random Llama with attention biases runs the native forward (the row-split
o_proj's bias is added once), split by heads, or (``llama-pp``, four ranks) by layers and heads; a
Qwen3-MoE transformers' own classes (q/k norms per head, a dense layer and a MoE one: experts cut,
router whole). Killing a rank ends its worker, whose stream resumes on another worker exactly, and
the launcher restarts the group; a rank (or a stage) that hangs ends its group after ``--dist-timeout``.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
import torch

from tests.conftest import Server, spawn, start_serve, stop, wait_until, worker_argv

PROMPTS = [
    "Hello there",
    "The capital of France is",
    "Hello there, tell me more about it",  # a prefix-cache hit on the first's blocks (block size 4)
    "Once upon a time, in a land far away, there lived a very old",  # chunked: an 8-token budget
]
NEW_TOKENS = 8
FLAGS = (
    "--tensor-parallel-size",
    "2",
    "--dtype",
    "float32",
    "--skip-self-check",
    "--block-size",
    "4",
    "--max-num-batched-tokens",
    "8",
    "--kv-cache-memory",
    "12KiB",  # 12 blocks of 4 tokens per rank: the batch below needs about 17, so requests are preempted
    "--dist-timeout",
    "5",
)
PP_FLAGS = ["--pipeline-parallel-size", "2"]


def build(folder: Path, model_type: str, extra: dict, tokenizer) -> Path:
    """A tiny random model of the family with the default model's tokenizer (a gateway needs one)."""
    from tests.worker import families

    sizes = dict(vocab_size=len(tokenizer), max_position_embeddings=2048, pad_token_id=None)
    ids = dict(eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    families.build(model_type, extra | sizes | ids, folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    from common.config import CACHE_DIR
    from common.model_source import load_tokenizer, resolve_model
    from tests.conftest import MODEL

    tmp = tmp_path_factory.mktemp("tp")
    tokenizer = load_tokenizer(resolve_model(MODEL), CACHE_DIR.env_default())
    return {
        "llama": build(tmp / "llama", "llama", dict(attention_bias=True), tokenizer),
        # layer 0 a dense MLP, layer 1 a MoE block (4 experts, top 2): both cuts, q/k norms too
        "qwen3-moe": build(tmp / "qwen3-moe", "qwen3_moe", dict(mlp_only_layers=[0]), tokenizer),
    }


@pytest.fixture(scope="module")
def served(models) -> Server:
    spec = ",".join(f"{name}={folder}" for name, folder in models.items())
    server = start_serve("tensor-parallel", 2, "--models", spec, "--workers", "1", *FLAGS)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def staged(served, models):
    """The llama as ``llama-pp``: four ranks, two pipeline stages of two tensor shares each (one
    layer and half its heads a rank: 6 KiB holds the same 12 blocks per rank as the others' 12 KiB),
    joined to the same gateway."""
    flags = [*FLAGS, *PP_FLAGS]
    flags[flags.index("12KiB")] = "6KiB"
    argv = ["--model", str(models["llama"]), "--served-model-name", "llama-pp", *flags]
    worker = spawn(worker_argv(served.zmq_address, "llama-pp", *argv), "pp-worker")
    try:
        wait_until(lambda: any(w["model"] == "llama-pp" for w in served.workers()), 120, "the pipeline worker")
        yield worker
    finally:
        stop(worker)


def complete(server: Server, model: str, prompt: str, max_tokens: int = NEW_TOKENS) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    response = server.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def generate(folder: Path, prompts: list[str], max_tokens: int = NEW_TOKENS) -> list[str]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    texts = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False)
        texts.append(tokenizer.decode(out[0, ids.shape[1] :]))
    return texts


def ranks(server: Server) -> dict[str, list[psutil.Process]]:
    """Each worker's rank processes (rank 0 first), by worker name, under the launcher."""
    groups: dict[str, list[psutil.Process]] = {}
    for process in psutil.Process(server.processes[0].pid).children(recursive=True):
        try:
            env = process.environ()
        except psutil.Error:
            continue
        if "LLMPOOL_WORKER_NAME" in env and "-m" in process.cmdline() and "worker" in process.cmdline():
            groups.setdefault(env["LLMPOOL_WORKER_NAME"], []).append((int(env.get("RANK", "0")), process))
    return {name: [p for _, p in sorted(found, key=lambda x: x[0])] for name, found in groups.items()}


@pytest.mark.parametrize("model", ["llama", "qwen3-moe", "llama-pp"])
def test_the_ranks_give_generates_tokens_alone_and_batched(served, models, model, request):
    """Two tensor shares, or (``llama-pp``) two pipeline stages of two tensor shares each."""
    if model == "llama-pp":
        request.getfixturevalue("staged")
    expected = generate(models[model.removesuffix("-pp")], PROMPTS)
    assert complete(served, model, PROMPTS[0]) == expected[0]  # alone
    preempted = lambda: any(w["preemptions"] for w in served.workers() if w["model"] == model)  # noqa: E731
    for _ in range(3):  # batched; again while no request got preempted (the four must overlap, which load can spoil)
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            assert list(pool.map(lambda p: complete(served, model, p), PROMPTS)) == expected
        try:
            wait_until(preempted, 3, f"the {model} worker's preemption (its load report)")
            break
        except TimeoutError:
            continue
    assert preempted(), f"no {model} request was preempted in three batches"


def test_each_worker_is_live_rank_processes_and_one_worker_to_the_gateway(served, staged):
    assert sorted(w["model"] for w in served.workers()) == ["llama", "llama-pp", "qwen3-moe"]
    groups = ranks(served)
    assert sorted(groups) == ["llama-worker-0", "qwen3-moe-worker-0"]
    staged_leader = psutil.Process(staged.pid)
    for leader, followers in [*((g[0], g[1:]) for g in groups.values()), (staged_leader, staged_leader.children())]:
        size = len(followers) + 1
        assert size == (4 if leader is staged_leader else 2)
        assert sorted(f.environ()["RANK"] for f in followers) == [str(r) for r in range(1, size)]
        for follower in followers:
            assert follower.is_running() and follower.status() != psutil.STATUS_ZOMBIE
            assert follower.ppid() == leader.pid  # rank 0 started it; a separate process, not a thread
            assert follower.environ()["WORLD_SIZE"] == str(size)


def test_a_killed_rank_ends_its_worker_and_its_stream_resumes_elsewhere_exactly(served, models):
    """A second llama worker (its own two ranks) joins; the stream's worker loses rank 1 mid-stream."""
    extra = spawn(
        worker_argv(served.zmq_address, "llama-extra", "--model", str(models["llama"]), *FLAGS), "tp-extra-worker"
    )
    try:
        wait_until(lambda: sum(w["model"] == "llama" for w in served.workers()) == 2, 120, "the extra llama worker")
        prompt, tokens = PROMPTS[1], 40  # 12 blocks at most
        expected = generate(models["llama"], [prompt], tokens)[0]
        body = {"model": "llama", "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
        body |= {"stream": True}
        text, killed = "", None
        with httpx.stream("POST", served.base_url + "/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                text += json.loads(line[6:])["choices"][0]["text"]
                if killed is None:
                    busy = [w["name"] for w in served.workers() if w["model"] == "llama" and w["inflight"]]
                    killed = leader_and_follower(served, extra, busy[0])
                    killed[1].kill()
        assert text == expected
        killed[0].wait(15)  # rank 0 noticed and exited: the gateway resumed its request elsewhere
        assert served.get("/workers").json()["resumed"] >= 1
        # The other llama group's rank 1 hangs (stopped, not dead): its next step's collective
        # times out after --dist-timeout and that group exits too, rather than staying wedged.
        survivor = "llama-worker-0" if killed[0].pid == extra.pid else "llama-extra"
        hung_leader, hung = leader_and_follower(served, extra, survivor)
        hung.suspend()
        deadline = time.monotonic() + 60
        while hung_leader.is_running() and time.monotonic() < deadline:
            served.post("/v1/completions", json=body | {"stream": False, "max_tokens": 2})
        assert not hung_leader.is_running() or hung_leader.status() == psutil.STATUS_ZOMBIE
    finally:
        stop(extra)


def leader_and_follower(server: Server, extra, name: str) -> tuple[psutil.Process, psutil.Process]:
    if name == "llama-extra":
        leader = psutil.Process(extra.pid)
        return leader, leader.children()[0]
    leader, follower = ranks(server)[name]
    return leader, follower


def test_a_hung_stage_ends_its_pipeline_worker(served, staged):
    """Stage 1 stopped (not dead): rank 0's next step times out after --dist-timeout and it exits."""
    leader = psutil.Process(staged.pid)
    for rank in leader.children():
        if rank.environ()["RANK"] in ("2", "3"):  # stage 1's two tensor shares
            rank.suspend()
    body = {"model": "llama-pp", "prompt": PROMPTS[0], "max_tokens": 2, "temperature": 0}
    post = lambda: httpx.post(served.base_url + "/v1/completions", json=body, timeout=20)  # noqa: E731
    threading.Thread(target=post, daemon=True).start()  # its answer (none: no other llama-pp worker) is not waited for
    assert staged.wait(60) == 1
    wait_until(lambda: all(w["model"] != "llama-pp" for w in served.workers()), 30, "the pipeline worker's removal")
