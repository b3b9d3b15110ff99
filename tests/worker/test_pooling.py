"""Pooling models in the engine, against sentence-transformers itself: tiny random embedders (BERT,
XLM-RoBERTa, ModernBERT, a Qwen3 decoder with last-token pooling) and a BERT cross-encoder, in
float32, each input alone and all in one step; cosine >= 0.9999 (scores within 1e-5)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from common.model_source import resolve_model
from common.pooling import PoolingInfo, PoolingParams
from common.protocol import FinishReason, NewRequest
from tests.worker import pooling_models
from tests.worker.fake_runner import FakeRunner
from worker.build import build_engine
from worker.config import WorkerConfig
from worker.engine import Engine
from worker.models.support import UnsupportedModel
from worker.pooling_spec import pooling_spec
from worker.scheduler import RunOutput, ScheduledBatch

st = pytest.importorskip("sentence_transformers")

TEXTS = [
    "the cat sat on the mat",
    "paris is the capital of france",
    "a dog",
    "which river is in paris, and was it one for the cat and the dog?",
]
DOCS = ["paris is the capital of france", "the cat sat on the mat", "a river", "dog"]


def engine_for(folder: Path, **flags: object) -> Engine:
    return build_engine(
        resolve_model(str(folder)), WorkerConfig(model=str(folder), dtype="float32", device="cpu", **flags)
    )


def run(engine: Engine, requests: list[NewRequest]) -> dict[str, object]:
    """Every request's final output; all are added before the first step (so they share it)."""
    for request in requests:
        engine.add_request(request)
    outputs = {}
    while engine.has_work():
        outputs.update({o.request_id: o for o in engine.step().outputs})
    return outputs


def embed_requests(ids: list[list[int]], dimensions: int | None = None) -> list[NewRequest]:
    return [NewRequest(f"r{i}", x, 1, pooling=PoolingParams("embed", dimensions=dimensions)) for i, x in enumerate(ids)]


def vector(output: object) -> np.ndarray:
    assert output.finish_reason == FinishReason.STOP and output.error is None, output
    return np.frombuffer(output.pooled, "<f4")


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pooling")
    made = {name: pooling_models.embedder(name, root / name) for name in pooling_models.EMBEDDERS}
    made["cross-encoder"] = pooling_models.cross_encoder(root / "cross-encoder")
    made["bert-bare"] = pooling_models.embedder("bert-mean", root / "bert-bare", seed=1, sentence_transformers=False)
    return made


@pytest.mark.parametrize("name", sorted(pooling_models.EMBEDDERS))
def test_embeddings_match_sentence_transformers_alone_and_batched(folders: dict[str, Path], name: str) -> None:
    model = st.SentenceTransformer(str(folders[name]), device="cpu")
    expected = model.encode(TEXTS, convert_to_numpy=True)
    ids = [model.tokenizer(t)["input_ids"] for t in TEXTS]
    engine = engine_for(folders[name])
    batched = run(engine, embed_requests(ids))
    assert engine.num_steps == 1  # all four rows in one step
    alone = [run(engine, embed_requests([x]))["r0"] for x in ids]
    for i, reference in enumerate(expected):
        assert cosine(vector(batched[f"r{i}"]), reference) >= 0.9999
        assert cosine(vector(alone[i]), reference) >= 0.9999
    assert engine.blocks.num_blocks == 0 and not engine.scheduler.running  # no KV cache, nothing left behind


def test_matryoshka_dimensions_cut_then_normalize(folders: dict[str, Path]) -> None:
    """The first ``dimensions`` values, normalized again (vLLM's and OpenAI's order); a model that
    does not declare Matryoshka dimensions refuses them."""
    model = st.SentenceTransformer(str(folders["qwen3-last"]), device="cpu", truncate_dim=16)
    expected = model.encode(TEXTS[:2], convert_to_numpy=True)
    ids = [model.tokenizer(t)["input_ids"] for t in TEXTS[:2]]
    out = run(engine_for(folders["qwen3-last"]), embed_requests(ids, dimensions=16))
    for i, reference in enumerate(expected):
        got = vector(out[f"r{i}"])
        assert got.shape == (16,) and abs(np.linalg.norm(got) - 1) < 1e-5
        assert cosine(got, reference) >= 0.9999
    refused = run(engine_for(folders["bert-mean"]), embed_requests(ids[:1], dimensions=16))["r0"]
    assert refused.bad_request and "dimensions" in refused.error


def test_cross_encoder_scores_match_sentence_transformers(folders: dict[str, Path]) -> None:
    model = st.CrossEncoder(str(folders["cross-encoder"]), device="cpu")
    expected = model.predict([(TEXTS[1], d) for d in DOCS])
    engine = engine_for(folders["cross-encoder"])
    assert engine.pooling.info.tasks == ["score"]
    requests = []
    for i, doc in enumerate(DOCS):
        pair = model.tokenizer(TEXTS[1], doc)
        requests.append(
            NewRequest(f"r{i}", pair["input_ids"], 1, pooling=PoolingParams("score", pair["token_type_ids"]))
        )
    out = run(engine, requests)
    scores = [float(vector(out[f"r{i}"])[0]) for i in range(len(DOCS))]
    assert np.allclose(scores, expected, atol=1e-5), (scores, expected)
    wrong = run(engine, embed_requests([requests[0].prompt_token_ids]))["r0"]
    assert wrong.bad_request and "does not do `embed`" in wrong.error
    generation = run(engine, [NewRequest("g", requests[0].prompt_token_ids, 4)])["g"]
    assert generation.bad_request and "does not generate" in generation.error


def test_pooling_flag_without_a_sentence_transformers_folder(folders: dict[str, Path]) -> None:
    """A bare encoder pools its first token and is normalized (--pooling auto); --pooling mean says otherwise."""
    from transformers import AutoModel, AutoTokenizer

    folder = folders["bert-bare"]
    tokens = AutoTokenizer.from_pretrained(folder)(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        states = AutoModel.from_pretrained(folder, dtype=torch.float32)(**tokens).last_hidden_state
    mask = tokens["attention_mask"].unsqueeze(-1).float()
    expected = {
        "auto": torch.nn.functional.normalize(states[:, 0], dim=-1),
        "mean": (states * mask).sum(1) / mask.sum(1),
    }
    ids = [
        [t for t, m in zip(row, keep) if m]
        for row, keep in zip(tokens["input_ids"].tolist(), tokens["attention_mask"].tolist())
    ]
    for flag, normalize in (("auto", True), ("mean", False)):
        out = run(engine_for(folder, pooling=flag, pooling_normalize=normalize), embed_requests(ids))
        for i in range(len(TEXTS)):
            assert cosine(vector(out[f"r{i}"]), expected[flag][i].numpy()) >= 0.9999
        if not normalize:
            assert abs(np.linalg.norm(vector(out["r0"])) - 1) > 1e-3


def test_a_causal_lm_with_pooling_generates_and_embeds_in_the_same_steps(tmp_path: Path) -> None:
    """``--pooling last`` on a causal LM checkpoint: its base model's last hidden state at the last
    token, normalized, as transformers computes it, from pooling rows that share a step with a
    generating request (whose greedy tokens stay generate's); ``auto`` leaves it generating only."""
    from transformers import AutoModel, AutoModelForCausalLM

    from tests.worker.families import build

    build("qwen3", {}, tmp_path)
    ids = [[5, 9, 14, 3], [7, 8, 9, 10, 11, 12, 3], [40, 3]]
    base = AutoModel.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = [
            torch.nn.functional.normalize(base(torch.tensor([x])).last_hidden_state[0, -1], dim=-1) for x in ids
        ]
        greedy = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).generate(
            torch.tensor([[4, 5, 6]]), max_new_tokens=6, do_sample=False
        )
    engine = engine_for(tmp_path, pooling="last", kv_cache_memory="16MiB")
    assert engine.pooling.info.tasks == ["generate", "embed", "score"]
    generation = NewRequest("gen", [4, 5, 6], 6, ignore_eos=True)
    generation.sampling.temperature = 0.0
    engine.add_request(generation)
    first = engine.step()  # the prompt's step
    assert first.outputs[0].new_token_ids
    for request in embed_requests(ids):
        engine.add_request(request)
    outputs = {o.request_id: o for o in engine.step().outputs}
    assert set(outputs) == {"gen", "r0", "r1", "r2"}  # a decode row and three pooling rows in one step
    tokens = first.outputs[0].new_token_ids + outputs["gen"].new_token_ids
    while engine.has_work():
        tokens += [t for o in engine.step().outputs for t in o.new_token_ids]
    assert tokens == greedy[0, 3:].tolist()
    for i, reference in enumerate(expected):
        assert cosine(vector(outputs[f"r{i}"]), reference.numpy()) >= 0.9999
    assert pooling_spec(str(tmp_path), ["Qwen3ForCausalLM"], False, "auto", True, causal=True) is None


def test_refusals_name_what_is_not_supported(tmp_path: Path) -> None:
    (tmp_path / "1_Pooling").mkdir()
    modules = [
        {"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
    ]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(UnsupportedModel, match="Dense"):
        pooling_spec(str(tmp_path), ["BertModel"], True, "auto", True)
    modules[1] = {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_weightedmean_tokens": True}))
    with pytest.raises(UnsupportedModel, match="weightedmean"):
        pooling_spec(str(tmp_path), ["BertModel"], True, "auto", True)
    with pytest.raises(ValueError, match="--pooling"):
        pooling_spec(str(tmp_path), ["BertModel"], True, "median", True)
    assert pooling_spec(str(tmp_path), ["LlamaForCausalLM"], False, "none", True) is None


class PoolingFakeRunner(FakeRunner):
    """A runner that both generates and pools (each vector: the row's token count)."""

    def __init__(self) -> None:
        super().__init__()
        self.pooling = PoolingInfo(["generate", "embed"], "mean", False, 1)
        self.pooled_batches: list[list[str]] = []

    def pool(self, rows: list[NewRequest]) -> list[bytes]:
        self.pooled_batches.append([r.request_id for r in rows])
        if any(r.request_id.startswith("poison") for r in rows):
            raise IndexError("poisoned row")
        return [np.array([len(r.prompt_token_ids)], "<f4").tobytes() for r in rows]


def test_pooling_rows_run_beside_generation_in_one_step_and_keep_no_blocks() -> None:
    runner = PoolingFakeRunner()
    engine = Engine(runner, WorkerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_prefill_chunk=64, block_size=4))
    free = engine.blocks.num_free_blocks
    engine.add_request(NewRequest("gen", [5, 6, 7], 4))
    engine.add_request(NewRequest("emb", [5, 6, 7, 8, 9], 1, pooling=PoolingParams("embed")))
    engine.add_request(NewRequest("poison", [5], 1, pooling=PoolingParams("embed")))
    step = engine.step()
    by_id = {o.request_id: o for o in step.outputs}
    assert set(by_id) == {"gen", "emb", "poison"} and step.batch_size == 3
    assert np.frombuffer(by_id["emb"].pooled, "<f4").tolist() == [5.0] and by_id["emb"].num_prompt_tokens == 5
    assert (
        by_id["poison"].finish_reason == FinishReason.ERROR and "poisoned" in by_id["poison"].error
    )  # alone: the other row kept its vector
    assert by_id["gen"].new_token_ids == [8]
    while engine.has_work():
        engine.step()
    assert engine.blocks.num_free_blocks == free and engine.blocks.hit_tokens == 0


def test_aborting_a_queued_pooling_request_and_the_budget_a_step_shares_with_its_batch() -> None:
    config = WorkerConfig(
        max_num_seqs=8, max_num_batched_tokens=8, max_prefill_chunk=8, block_size=4, pooling_share=1.0
    )
    engine = Engine(PoolingFakeRunner(), config)
    for i in range(4):
        engine.add_request(NewRequest(f"e{i}", [1, 2, 3], 1, pooling=PoolingParams("embed")))
    (aborted,) = engine.abort(["e3"])
    assert aborted.finish_reason == FinishReason.ABORT
    assert [sorted(o.request_id for o in engine.step().outputs) for _ in range(2)] == [
        ["e0", "e1"],
        ["e2"],
    ]  # 8 tokens a step
    assert not engine.has_work()
    engine.add_request(NewRequest("gen", list(range(1, 8)), 2))  # the batch takes 7 of the step's 8 tokens
    for i in range(2):
        engine.add_request(NewRequest(f"p{i}", [1, 2, 3], 1, pooling=PoolingParams("embed")))
    assert [sorted(o.request_id for o in engine.step().outputs) for _ in range(2)] == [
        ["gen", "p0"],
        ["gen", "p1"],
    ]  # at least one a step
    engine.add_request(NewRequest("long", list(range(1, 2000)), 1, pooling=PoolingParams("embed")))
    (too_long,) = engine.step().outputs
    assert too_long.bad_request and "more than this model's limit" in too_long.error


class TimedRunner(PoolingFakeRunner):
    """Steps that take time on a clock of its own: a pooling call 60 ms, a generation step 10 ms
    (on 2 CPU cores a 128-token pooling row's torch forward takes 45-85 ms, a decode step 6-10 ms)."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def pool(self, rows: list[NewRequest]) -> list[bytes]:
        self.now += 0.06
        return super().pool(rows)

    def execute(self, batch: ScheduledBatch) -> RunOutput:
        self.now += 0.01
        return super().execute(batch)


@pytest.mark.parametrize("share", [0.5, 0.25, 1.0])
def test_pooling_rows_take_their_share_of_the_time_beside_generation_and_all_of_it_alone(monkeypatch, share) -> None:
    """A steady embedding queue beside a decoding stream: pooling rows take about ``--pooling-share``
    of the step time (1: a row in every step), never starve, and run in every step once nothing
    generates."""
    import time
    import types

    runner = TimedRunner()
    fake_time = types.SimpleNamespace(perf_counter=runner.clock, monotonic=time.monotonic, time=time.time)
    monkeypatch.setattr("worker.pooling.time", fake_time)
    monkeypatch.setattr("worker.engine.time", fake_time)
    config = WorkerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_prefill_chunk=64, block_size=4)
    engine = Engine(runner, replace(config, pooling_share=share))
    engine.add_request(NewRequest("gen", [5, 6, 7], 200, ignore_eos=True))
    for i in range(40):
        engine.add_request(NewRequest(f"e{i}", [1] * 60, 1, pooling=PoolingParams("embed")))  # one a step
    beside = []  # per step while generating: whether it carried a pooling row
    while any(r.request_id == "gen" for r in engine.scheduler.running + list(engine.scheduler.waiting)):
        before = len(runner.pooled_batches)
        engine.step()
        beside.append(len(runner.pooled_batches) > before)
    pooled_s, steps = 0.06 * sum(beside), len(beside)
    fraction = pooled_s / (pooled_s + 0.01 * steps)
    if share == 1.0:
        assert all(beside[:40])  # a row in every step until the queue ran dry
    else:
        assert share - 0.06 <= fraction <= share + 0.02, (fraction, beside[:30])  # within one row's time
    left = len(engine.pooling.waiting)
    assert left < 40  # never starved
    engine.step()
    assert len(engine.pooling.waiting) < left or not left  # alone: every step


@pytest.mark.parametrize("share", [0.0, -0.5, 1.5])
def test_a_pooling_share_outside_0_to_1_is_refused_at_start(share) -> None:
    with pytest.raises(ValueError, match="--pooling-share must be in"):
        Engine(PoolingFakeRunner(), WorkerConfig(pooling_share=share))
