"""LoRA adapters in the engine, in-process: greedy float32 output equals peft's merged model, for
each adapter alone and for rows of two adapters and the base model mixed in one batch, for a Llama
and a Qwen2 (its QKV biases); eviction with ``--max-loras 1``; the prefix cache keyed by adapter;
adapters the worker cannot apply refused by name."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from common.lora import LoraCommand
from common.model_source import resolve_model
from common.protocol import NewRequest, Ready, SamplingParams
from tests.worker.families import SERVED, build
from tests.worker.lora_adapters import make_adapter, merged
from worker.config import WorkerConfig
from worker.engine import Engine
from worker.lora.adapter import AdapterError, Dims, load_adapter
from worker.lora.registry import answer
from worker.models.fused_decode import FusedDecode
from worker.runner import ModelRunner

_generator = torch.Generator().manual_seed(1)
PROMPTS = [torch.randint(3, 250, (n,), generator=_generator).tolist() for n in (12, 23, 37)]
NEW_TOKENS = 8
CONFIG = WorkerConfig(dtype="float32", block_size=4, kv_cache_memory="4MiB", max_num_batched_tokens=64)


def generate(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, len(prompt) :].tolist()


def run(engine: Engine, jobs: list[tuple[list[int], str | None]]) -> list[list[int]]:
    """Greedy outputs of (prompt, adapter) jobs added together; checks that no KV block leaked."""
    for i, (prompt, lora) in enumerate(jobs):
        engine.add_request(
            NewRequest(f"r{i}", prompt, NEW_TOKENS, SamplingParams(temperature=0), ignore_eos=True, lora=lora)
        )
    out: list[list[int]] = [[] for _ in jobs]
    while engine.has_work():
        for o in engine.step().outputs:
            assert o.error is None, o.error
            out[int(o.request_id[1:])].extend(o.new_token_ids)
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks, "KV blocks leaked"
    return out


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def family(request, tmp_path_factory):
    """A tiny random model of the family, two random adapters (rank 8 on every projection, rank 4 on
    q/v only), and the references: greedy tokens of every prompt from each merged model."""
    folder = tmp_path_factory.mktemp(request.param)
    model_type, extra = SERVED[request.param]
    build(model_type, extra, folder / "model")
    adapters = {
        "a": make_adapter(folder / "model", folder / "a", seed=1),
        "b": make_adapter(folder / "model", folder / "b", seed=2, rank=4, targets=["q_proj", "v_proj"]),
    }
    reference = {}
    for name in (None, "a", "b"):
        model = merged(folder / "model", adapters.get(name))
        model.generation_config.eos_token_id = None
        reference[name] = [generate(model, p) for p in PROMPTS]
    assert reference["a"] != reference[None] and reference["b"] != reference[None], "the adapters change nothing"
    return folder, adapters, reference


def engine_for(folder: Path, adapters: dict[str, Path], **settings: object) -> Engine:
    config = replace(CONFIG, lora=[f"{name}={path}" for name, path in adapters.items()], **settings)
    return Engine(ModelRunner(resolve_model(str(folder / "model")), config), config)


def test_float32_greedy_equals_the_merged_model_alone_and_mixed(family):
    folder, adapters, reference = family
    engine = engine_for(folder, adapters)
    for name in ("a", "b"):  # alone
        assert run(engine, [(PROMPTS[1], name)]) == [reference[name][1]]
    # Mixed: every prompt under every adapter and the base, in one batch (prompt chunks and decodes).
    jobs = [(p, name) for name in (None, "a", "b") for p in PROMPTS]
    expected = [reference[name][i] for name in (None, "a", "b") for i in range(len(PROMPTS))]
    assert run(engine, jobs) == expected


def test_the_cpp_step_adds_each_rows_adapter(family):
    """The C++ step (worker/kernels/decode_step.cpp) on float32 weights, every prompt's tokens as
    rows of one call, under the base, a and b: each prompt's logits are its merged model's."""
    folder, adapters, _ = family
    fused = FusedDecode(merged(folder / "model", None), "none")
    dims, cpu = Dims.of(fused.decoder.config), torch.device("cpu")
    loaded = {name: load_adapter(name, str(path), dims, 16, torch.float32, cpu) for name, path in adapters.items()}
    f, block = fused.family, 4
    rows: list[tuple[int, int, list[int]]] = []  # (token, position, pages)
    segments, first_page = [], 0
    for prompt, name in zip(PROMPTS, (None, "a", "b")):
        pages = list(range(first_page, first_page + -(-len(prompt) // block)))
        first_page += len(pages)
        if name is not None:
            segments.append((loaded[name], len(rows), len(rows) + len(prompt)))
        rows += [(token, position, pages) for position, token in enumerate(prompt)]
    caches = [tuple(torch.zeros(first_page, block, f.kv_heads, f.head_dim) for _ in range(2)) for _ in f.layers]
    width = max(len(pages) for _, _, pages in rows)
    positions = torch.tensor([position for _, position, _ in rows])
    got = fused(
        torch.tensor([token for token, _, _ in rows]),
        positions,
        caches,
        torch.tensor([pages[p // block] * block + p % block for _, p, pages in rows]),
        torch.tensor([pages + [0] * (width - len(pages)) for _, _, pages in rows]),
        positions + 1,
        lora=segments,
    )
    start = 0
    for prompt, name in zip(PROMPTS, (None, "a", "b")):
        with torch.no_grad():
            want = merged(folder / "model", adapters.get(name))(torch.tensor([prompt])).logits[0]
        mine = got[start : start + len(prompt)]
        assert (mine - want).abs().max().item() < 1e-4 * (1 + want.abs().max().item()), name
        start += len(prompt)


def test_quantized_decodes_carry_adapters_in_the_cpp_step(family):
    """With int8 weights the adapters' decode rows run in the C++ step (no longer the torch path),
    and every token is in the merged float32 model's top 5 (vLLM's closeness rule)."""
    folder, adapters, _ = family
    engine = engine_for(folder, adapters, quantization="int8")
    paths, carried = engine.runner.paths, []
    cpp_step = paths.rows
    paths.rows = lambda inputs, lora=None: carried.append(bool(lora)) or cpp_step(inputs, lora)
    jobs = [(p, name) for name in (None, "a", "b") for p in PROMPTS]
    outputs = run(engine, jobs)
    assert sum(carried) >= NEW_TOKENS - 1, carried  # every step that decoded adapters' rows
    for (prompt, name), out in zip(jobs, outputs):
        with torch.no_grad():
            logits = merged(folder / "model", adapters.get(name))(torch.tensor([prompt + out])).logits[0]
        top5 = logits[len(prompt) - 1 : -1].topk(5, dim=-1).indices
        assert all(token in top for token, top in zip(out, top5.tolist())), (name, prompt)


def test_max_loras_1_alternates_two_adapters_exactly(family):
    """One adapter resident at a time: requests of the other wait, then it is read back from disk."""
    folder, adapters, reference = family
    engine = engine_for(folder, adapters, max_loras=1)
    loads = engine.loras.loads
    jobs = [(PROMPTS[0], "a"), (PROMPTS[0], "b"), (PROMPTS[2], "a"), (PROMPTS[2], None), (PROMPTS[1], "b")]
    assert run(engine, jobs) == [reference[name][PROMPTS.index(p)] for p, name in jobs]
    assert len(engine.loras.resident) == 1 and engine.loras.loads >= loads + 2


def test_prefix_cache_is_keyed_by_adapter(family):
    """The same prompt under the base, then adapter a, then b, then a again: only the last one hits
    the cache (blocks computed under a), and every output is its own model's."""
    folder, adapters, reference = family
    engine = engine_for(folder, adapters)
    hits = []
    for name in (None, "a", "b", "a"):
        before = engine.blocks.hit_tokens
        assert run(engine, [(PROMPTS[2], name)]) == [reference[name][2]]
        hits.append(engine.blocks.hit_tokens - before)
    assert hits[:3] == [0, 0, 0] and hits[3] > 0


def test_load_and_unload_between_steps_and_unknown_adapters(family, tmp_path):
    """A command loads an adapter (its requests then run exactly), unloads it (then a request
    naming it is refused as a bad request naming the model), and a bad folder is refused by name."""
    folder, adapters, reference = family
    engine = engine_for(folder, {})
    ready = Ready("w", "m", 0, 0, 0, 0, "cpu", "float32")
    result = answer(engine.loras, LoraCommand(1, "b", str(adapters["b"])), ready)
    assert result.error is None and ready.lora.adapters == {"b": str(adapters["b"])}
    assert run(engine, [(PROMPTS[0], "b"), (PROMPTS[0], None)]) == [reference["b"][0], reference[None][0]]
    assert answer(engine.loras, LoraCommand(2, "b", unload=True), ready).error is None
    assert ready.lora.adapters == {}
    assert answer(engine.loras, LoraCommand(4, "b", unload=True), ready).error is None, "a second unload: done already"
    engine.add_request(NewRequest("x", PROMPTS[0], 4, lora="b"))
    (out,) = engine.step().outputs
    assert out.bad_request and "`b` does not exist" in out.error
    missing = answer(engine.loras, LoraCommand(3, "c", str(tmp_path)), ready)
    assert "adapter_config.json" in missing.error and "`c`" in missing.error


def test_adapters_the_worker_cannot_apply_are_refused_by_name(family, tmp_path):
    folder, adapters, _ = family
    engine = engine_for(folder, {}, max_lora_rank=4)
    with pytest.raises(AdapterError, match=r"`a` has rank 8, more than this worker's --max-lora-rank \(4\)"):
        engine.loras.register("a", str(adapters["a"]))
    dora = tmp_path / "dora"
    dora.mkdir()
    config = json.loads((adapters["b"] / "adapter_config.json").read_text()) | {"use_dora": True}
    (dora / "adapter_config.json").write_text(json.dumps(config))
    (dora / "adapter_model.safetensors").write_bytes((adapters["b"] / "adapter_model.safetensors").read_bytes())
    with pytest.raises(AdapterError, match="`d`: this worker cannot apply `use_dora`"):
        engine.loras.register("d", str(dora))


def test_lora_is_refused_at_start_where_the_native_forward_does_not_run(family):
    folder, adapters, _ = family
    with pytest.raises(ValueError, match="--lora cannot be used here: .*native forward"):
        engine_for(folder, adapters, model_impl="transformers")


def test_lora_flag_takes_name_equals_path_repeated_or_comma_separated(monkeypatch):
    import argparse

    from common.config import add_flags
    from worker.config import WORKER_FLAGS
    from worker.lora.registry import parse_specs

    parser = argparse.ArgumentParser()
    add_flags(parser, "worker", WORKER_FLAGS)
    assert parse_specs(parser.parse_args(["--lora", "a=/x", "--lora", "b=/y,c=/z"]).lora) == {
        "a": "/x",
        "b": "/y",
        "c": "/z",
    }
    monkeypatch.setenv("LLMPOOL_LORA", "d=/w")
    parser = argparse.ArgumentParser()
    add_flags(parser, "worker", WORKER_FLAGS)
    assert parser.parse_args([]).lora == ["d=/w"] and parser.parse_args(["--lora", "e=/v"]).lora == ["e=/v"]
    for bad, why in (("a", "NAME=PATH"), ("a=/x,a=/y", "twice")):
        with pytest.raises(ValueError, match=why):
            parse_specs([bad])
