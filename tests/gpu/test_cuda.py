"""The worker on a CUDA device, with the default model and a 1B-class Llama with random weights
(bench/random_llama.py): float32 greedy output equals transformers' ``generate`` under batching,
chunked prefill, prefix caching and preemption; bf16 with CUDA graphs and the Triton attention or
FlashInfer (where it is installed) passes vLLM's closeness test; a SIGKILLed GPU worker's stream
resumes on another worker.

Skipped without a GPU (CI has none); bench/gpu.sh runs them on a GPU machine.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from common.config import CACHE_DIR
from common.model_source import DEFAULT_MODEL, resolve_model
from common.protocol import NewRequest, SamplingParams, TokenLogprobs
from tests.conftest import MODEL, Server, free_port, spawn, worker_argv
from worker.attention import flashinfer_decode
from worker.build import build_engine
from worker.config import WorkerConfig
from worker.engine import Engine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = [
    [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 2, 198, 1, 4093, 198, 19556, 2, 198, 1, 520, 9531, 198],
    [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198],
    [1, 4093, 198, 31530, 253, 1403, 21881, 563, 260, 5304, 30, 2, 198, 1, 520, 9531, 198],
    [1, 4093, 198, 7306, 260, 2400, 282, 24546, 30, 2, 198, 1, 520, 9531, 198] * 3,
]
NEW_TOKENS = 24
TOP = 5


@pytest.fixture(scope="module", params=["default", "llama-1b"])
def model_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    if request.param == "default":
        try:
            resolve_model(DEFAULT_MODEL)
        except ValueError as exc:
            pytest.skip(str(exc))
        return DEFAULT_MODEL
    from bench.random_llama import build

    built = os.environ.get("LLMPOOL_TEST_LLAMA_1B")  # bench/gpu.sh builds it once for the tests and the benchmark
    folder = Path(built) if built else tmp_path_factory.mktemp("llama-1b") / "model"
    return str(build(folder, "1b", os.environ.get("LLMPOOL_TEST_TOKENIZER")))


@pytest.fixture(scope="module")
def reference(model_path: str) -> dict[str, list]:
    """transformers' greedy ``generate`` on the GPU: float32 tokens, bf16 tokens with their top-5 logprobs."""
    from worker.loader import load_model

    source = resolve_model(model_path)
    out: dict[str, list] = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(source, dtype, CACHE_DIR.env_default()).cuda().eval()
        runs = []
        with torch.inference_mode():
            for prompt in PROMPTS:
                result = model.generate(
                    torch.tensor([prompt], device="cuda"),
                    max_new_tokens=NEW_TOKENS,
                    do_sample=False,
                    output_logits=True,
                    return_dict_in_generate=True,
                )
                tokens = result.sequences[0, len(prompt) :].tolist()
                tops = [torch.log_softmax(step[0].float(), -1).topk(TOP).indices.tolist() for step in result.logits]
                runs.append((tokens, tops))
        out[str(dtype)] = runs
        del model
        torch.cuda.empty_cache()
    return out


def engine(model_path: str, **settings: object) -> Engine:
    return build_engine(resolve_model(model_path), WorkerConfig(model=model_path, device="cuda", **settings))


def run(
    eng: Engine, prompts: list[list[int]], logprobs: int | None = None, tag: str = "r"
) -> dict[str, tuple[list[int], list[TokenLogprobs]]]:
    for i, ids in enumerate(prompts):
        eng.add_request(NewRequest(f"{tag}{i}", ids, NEW_TOKENS, SamplingParams(temperature=0, logprobs=logprobs)))
    out: dict[str, tuple[list[int], list[TokenLogprobs]]] = {}
    while eng.has_work():
        for o in eng.step().outputs:
            assert o.error is None, o.error
            tokens, lps = out.setdefault(o.request_id, ([], []))
            tokens.extend(o.new_token_ids)
            lps.extend(o.logprobs or [])
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks, "KV blocks leaked"
    return out


def blocks_budget(model_path: str, blocks: int, block_size: int) -> str:
    """Bytes of ``blocks`` float32 KV blocks of the model: few enough that requests get preempted."""
    config = resolve_model(model_path)
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(config.path, gguf_file=config.gguf_file)
    per_block = (
        2 * c.num_hidden_layers * block_size * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 4
    )
    return str(per_block * blocks)


@pytest.mark.parametrize("setting", ["batched", "chunked-prefill", "prefix-cache", "preemption"])
def test_float32_greedy_output_matches_generate_on_cuda(model_path, reference, setting):
    settings: dict[str, object] = {"dtype": "float32", "kv_cache_memory": "1GiB"}
    if setting == "chunked-prefill":
        settings["max_num_batched_tokens"] = 7
    if setting == "preemption":
        settings |= {"block_size": 4, "kv_cache_memory": blocks_budget(model_path, 18, 4)}
    eng = engine(model_path, **settings)
    assert eng.runner.paths.graphs is None and eng.runner.decode_backend == "eager", (
        "float32 keeps the exact eager path"
    )
    expected = [tokens for tokens, _ in reference[str(torch.float32)]]
    out = run(eng, PROMPTS)
    assert [out[f"r{i}"][0] for i in range(len(PROMPTS))] == expected
    if setting == "prefix-cache":
        again = run(eng, PROMPTS, tag="again")
        assert eng.blocks.hit_tokens > 0, "the second run should start from the prefix cache"
        assert [again[f"again{i}"][0] for i in range(len(PROMPTS))] == expected
    if setting == "preemption":
        assert eng.scheduler.num_preemptions > 0


def close(ours: tuple[list[int], list[TokenLogprobs]], theirs: tuple[list[int], list[list[int]]]) -> bool:
    """vLLM's check_logprobs_close: up to the first difference the texts agree; there each side's
    token is among the other's top-5, and nothing after it is compared."""
    our_tokens, our_lps = ours
    ref_tokens, ref_tops = theirs
    for i, (a, b) in enumerate(zip(our_tokens, ref_tokens)):
        if a != b:
            return a in ref_tops[i] and b in our_lps[i].top_ids
    return len(our_tokens) == len(ref_tokens)


def needs(attention: str) -> None:
    if attention == "flashinfer" and not flashinfer_decode.available():
        pytest.skip("FlashInfer is not installed here")


@pytest.mark.parametrize("attention", ["triton", "flashinfer"])
@pytest.mark.parametrize("graphs", ["on", "off"])
def test_bf16_decode_with_cuda_graphs_is_close_to_generate(model_path, reference, graphs, attention):
    needs(attention)
    eng = engine(model_path, dtype="bfloat16", kv_cache_memory="2GiB", cuda_graphs=graphs, cuda_attention=attention)
    assert eng.runner.decode_backend == attention
    out = run(eng, PROMPTS * 2, logprobs=TOP)  # 8 rows at once: the graph of the 8-row bucket
    if graphs == "on":
        assert eng.runner.paths.graphs is not None and eng.runner.paths.graphs.replays > 0
    else:
        assert eng.runner.paths.graphs is None
    refs = reference[str(torch.bfloat16)] * 2
    results = [close(out[f"r{i}"], refs[i]) for i in range(len(refs))]
    exact = sum(out[f"r{i}"][0] == refs[i][0] for i in range(len(refs)))
    print(
        f"{model_path} bf16 {attention} graphs={graphs}: {exact}/{len(refs)} identical, {sum(results)}/{len(refs)} close"
    )
    assert all(results)


@pytest.mark.parametrize("attention", ["triton", "flashinfer"])
def test_eager_and_kernel_attention_agree_in_bf16(model_path, reference, attention):
    """The eager gather + matmul and the Triton kernel or FlashInfer read the same cache: close outputs."""
    needs(attention)
    eager = run(
        engine(model_path, dtype="bfloat16", kv_cache_memory="2GiB", cuda_graphs="off", cuda_attention="eager"),
        PROMPTS,
        logprobs=TOP,
    )
    kernel = run(
        engine(model_path, dtype="bfloat16", kv_cache_memory="2GiB", cuda_attention=attention), PROMPTS, logprobs=TOP
    )
    for i in range(len(PROMPTS)):
        ref = (eager[f"r{i}"][0], [lp.top_ids for lp in eager[f"r{i}"][1]])
        assert close(kernel[f"r{i}"], ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(9, 3, 64), (32, 8, 64), (32, 8, 128)], ids=["smollm2", "llama-1b", "llama-8b"])
def test_flashinfer_passes_its_start_up_check(heads, dtype):
    """The check a worker runs before it uses FlashInfer (random pages, against the eager gather)."""
    needs("flashinfer")
    query_heads, kv_heads, head_dim = heads
    assert flashinfer_decode.check(query_heads, (16, kv_heads, head_dim), dtype, torch.device("cuda")) is None


def test_a_sigkilled_cuda_worker_stream_resumes_on_the_other_worker(model_path):
    if model_path != DEFAULT_MODEL:
        pytest.skip("the fault path does not depend on the model")
    import openai

    server = Server(free_port(), free_port())
    env = {"LLMPOOL_HEARTBEAT_INTERVAL": "0.5", "LLMPOOL_HEARTBEAT_LIVENESS": "4"}
    server.processes.append(
        spawn(["gateway", "--port", str(server.port), "--zmq-bind", server.zmq_address], "gpu-gateway", env)
    )
    workers = {}
    for name in ("g-a", "g-b"):
        args = worker_argv(server.zmq_address, name, "--device", "cuda", "--dtype", "float32")
        workers[name] = spawn(args, f"gpu-{name}", env)
        server.processes.append(workers[name])
    try:
        server.wait_for_workers(2)
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
        killed: list[str] = []

        def stream(kill_at: int | None) -> str:
            text = []
            for chunk in client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Describe a walk through an old forest."}],
                temperature=0,
                max_tokens=200,
                stream=True,
                extra_body={"ignore_eos": True},
            ):
                if chunk.choices and chunk.choices[0].delta.content:
                    text.append(chunk.choices[0].delta.content)
                    if len(text) == kill_at and not killed:
                        (busy,) = [w["name"] for w in server.workers() if w["inflight"]]
                        workers[busy].send_signal(signal.SIGKILL)
                        killed.append(busy)
            return "".join(text)

        reference_text = stream(None)
        resumed = stream(12)
        assert killed, "a worker should have been killed mid-stream"
        assert resumed == reference_text
        assert server.get("/workers").json()["resumed"] == 1
    finally:
        server.stop()
