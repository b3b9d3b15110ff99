"""Every family a worker serves, served right; every family it cannot serve, refused at load by name.

One tiny random model per family (tests/worker/families.py), the engine in-process. In float32 the
greedy output must equal transformers' ``generate`` token for token: batched, with chunked prefill
(a 7-token budget), a prefix-cache hit (the first prompt twice), preemption (16 blocks of 4 tokens
for 4 requests) and every prompt longer than the 8-token sliding windows and attention chunks; and
alone with the whole prompt in one step. In bfloat16, for the families whose attention has a
feature of its own, vLLM's closeness rule. Then the refusals: by name, by what the start-up probe
finds, and by the self-check when the serving path computes something else than the model.

``LLMPOOL_TEST_DEVICE=cuda`` runs the engine and the reference on a GPU (bench/gpu.sh's ``families``
step); the default is the CPU.
"""

from __future__ import annotations

import os
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from bench.accuracy import Generation, check_close
from common.model_source import resolve_model
from common.protocol import NewRequest, SamplingParams
from tests.worker.families import GGUF, REFUSED, SERVED, WINDOW, build, write_gguf
from worker import cpu, kernels
from worker.attention.layers import LayerSpec
from worker.config import WorkerConfig
from worker.engine import Engine
from worker.loader import load_model
from worker.models import support
from worker.models.fused_decode import SLOTS
from worker.runner import ModelRunner

_generator = torch.Generator().manual_seed(0)
PROMPTS = [torch.randint(3, 250, (n,), generator=_generator).tolist() for n in (12, 23, 37)]
NEW_TOKENS = 8
DEVICE = os.environ.get("LLMPOOL_TEST_DEVICE", "cpu")
CONFIG = WorkerConfig(dtype="float32", device=DEVICE, block_size=4, kv_cache_memory="4MiB", max_num_batched_tokens=7)
assert min(map(len, PROMPTS)) > WINDOW  # the windows must cut, or the tests prove nothing


def run(engine: Engine, prompts: list[list[int]], logprobs: int | None = None) -> list[Generation]:
    """Greedy generations of ``prompts``, added together; checks that no KV block leaked."""
    for i, prompt in enumerate(prompts):
        engine.add_request(
            NewRequest(f"r{i}", prompt, NEW_TOKENS, SamplingParams(temperature=0, logprobs=logprobs), ignore_eos=True)
        )
    out = [Generation([], [], []) for _ in prompts]
    while engine.has_work():
        for o in engine.step().outputs:
            assert o.error is None, o.error
            out[int(o.request_id[1:])].tokens.extend(o.new_token_ids)
            out[int(o.request_id[1:])].top.extend(lp.top_ids for lp in o.logprobs or [])
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks, "KV blocks leaked"
    return out


def generate(model: torch.nn.Module, prompts: list[list[int]], top: int = 5) -> list[Generation]:
    out = []
    model = model.to(DEVICE)
    with torch.inference_mode():
        for prompt in prompts:
            result = model.generate(
                torch.tensor([prompt], device=DEVICE),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
            out.append(
                Generation(
                    result.sequences[0, len(prompt) :].tolist(),
                    [],
                    [step[0].topk(top).indices.tolist() for step in result.logits],
                )
            )
    return out


@pytest.mark.parametrize("name", sorted(SERVED))
def test_float32_greedy_output_equals_generate_batched_chunked_preempted_and_alone(name, tmp_path):
    model_type, extra = SERVED[name]
    model = build(model_type, extra, tmp_path / "model")
    reference = [g.tokens for g in generate(model, PROMPTS)]
    runner = ModelRunner(resolve_model(str(tmp_path / "model")), CONFIG)
    runner.num_blocks = 16  # the block manager gets 16 of them: 4 requests of up to 12 blocks preempt each other
    engine = Engine(runner, CONFIG)
    batched = run(engine, [*PROMPTS, PROMPTS[0]])
    assert [g.tokens for g in batched] == [*reference, reference[0]]
    assert engine.scheduler.num_preemptions > 0 and engine.blocks.hit_tokens > 0
    alone = run(Engine(runner, replace(CONFIG, max_num_batched_tokens=512)), PROMPTS[2:])
    assert alone[0].tokens == reference[2]


def test_speculative_drafts_verified_through_windows_and_sinks_keep_the_output(tmp_path):
    """--speculate: a lone request's drafts are verified as a prompt chunk over its cached context,
    through the window and the sinks (gpt-oss), and the output stays generate's."""
    model_type, extra = SERVED["gpt_oss"]
    model = build(model_type, extra, tmp_path)
    prompts = [prompt * 3 for prompt in PROMPTS[:2]]  # repeated text: the n-gram drafts find matches
    config = replace(CONFIG, speculate=3, max_num_batched_tokens=512)
    engine = Engine(ModelRunner(resolve_model(str(tmp_path)), config), config)
    assert [run(engine, [prompt])[0].tokens for prompt in prompts] == [g.tokens for g in generate(model, prompts)]
    assert engine.speculator.accepted_tokens > 0


# On the CPU the families whose attention has a feature of its own; on a GPU every family (there
# bf16 runs the decode kernels, the fused rotary and CUDA graphs, which float32 does not).
BF16 = (
    ["mistral", "gemma2", "gpt_oss", "llama4_text", "deepseek_v3", "qwen2-window"]
    if DEVICE == "cpu"
    else sorted(SERVED)
)


@pytest.mark.skipif(DEVICE == "cpu" and not cpu.native_bf16(), reason="bf16 is served only where the CPU computes it")
@pytest.mark.parametrize("name", BF16)
def test_bfloat16_output_is_close_to_generate(name, tmp_path):
    """bf16: where the texts part, each side's token is in the other's top 5 (vLLM's rule)."""
    model_type, extra = SERVED[name]
    model = build(model_type, extra, tmp_path / "model").to(torch.bfloat16)
    reference = generate(model, PROMPTS)
    config = replace(CONFIG, dtype="bfloat16", quantization="none")
    got = run(Engine(ModelRunner(resolve_model(str(tmp_path / "model")), config), config), PROMPTS, logprobs=5)
    assert all(check_close(g, r)[0] for g, r in zip(got, reference))


# Every family on transformers' classes; those the native forward takes on it too (a Mistral file
# is a Llama one: llama.cpp writes it so, and it loads as one).
GGUF_CASES = [(name, "transformers") for name in sorted(GGUF)] + [("qwen2", "native"), ("mistral", "native")]


@pytest.mark.parametrize(("name", "impl"), GGUF_CASES)
def test_a_gguf_file_of_each_family_loads_through_transformers_and_is_exact(name, impl, tmp_path):
    """A float32 .gguf written as llama.cpp writes it (rotary permutation, Gemma's norm offset, fused
    Phi-3 projections, Qwen3's head size in the key length) serves as its safetensors do."""
    model_type, extra = GGUF[name]
    model = build(model_type, extra, tmp_path / "hf")
    with torch.no_grad():  # sharp attention, so that rotary dimensions read in another order change the tokens
        for weight, parameter in model.named_parameters():
            if weight.endswith(("q_proj.weight", "k_proj.weight", "qkv_proj.weight")):
                parameter.mul_(8)
    gguf_file = write_gguf(model, tmp_path / "gguf" / f"tiny-{name}.gguf")
    reference = [g.tokens for g in generate(model, PROMPTS)]
    config = replace(CONFIG, model_impl=impl, cache_dir=str(tmp_path / "cache"))
    runner = ModelRunner(resolve_model(str(gguf_file)), config)
    assert [g.tokens for g in run(Engine(runner, config), PROMPTS)] == reference


def test_a_gguf_file_of_a_family_transformers_does_not_read_is_refused_by_architecture(tmp_path):
    """Gemma (1), OLMo, Granite, Cohere, Phi, SmolLM3, ...: transformers' GGUF support has no
    mapping for them, and the worker stops with its sentence rather than guess."""
    gguf_file = write_gguf(build("gemma", {}, tmp_path / "hf"), tmp_path / "gguf" / "tiny-gemma.gguf")
    with pytest.raises(ValueError, match="GGUF model with architecture gemma is not supported"):
        ModelRunner(resolve_model(str(gguf_file)), replace(CONFIG, cache_dir=str(tmp_path / "cache")))


def test_a_gguf_mixture_of_experts_that_loads_as_a_dense_model_is_refused(tmp_path):
    """Mixtral's files are llama.cpp's llama architecture plus expert tensors; a file whose experts
    transformers would drop (here: a llama file that says it has 4) is refused, never served wrong."""
    model = build("llama", {}, tmp_path / "hf")
    gguf_file = write_gguf(model, tmp_path / "gguf" / "tiny-moe.gguf", extra={"llama.expert_count": 4})
    with pytest.raises(ValueError, match="mixture of 4 experts, which transformers loaded as a dense LlamaForCausalLM"):
        ModelRunner(resolve_model(str(gguf_file)), replace(CONFIG, cache_dir=str(tmp_path / "cache")))


@pytest.mark.skipif(DEVICE != "cpu" or not kernels.load(), reason="the q4 weights are the CPU's C++ step's")
@pytest.mark.parametrize(("name", "kind"), [("qwen3", "Q4_0"), ("gemma2", "Q4_1"), ("qwen3", "Q4_K_M")])
def test_a_4bit_gguf_file_keeps_its_weights_on_the_q4_path(name, kind, tmp_path):
    """A 4-bit file of a family the C++ step runs: in bf16 its weights go to the step as q4 (auto
    sees them on a 4-bit grid), and the output is close to generate on the de-quantized weights.
    Q4_K_M (rows of 256): the Q4_K matrices come back on their grids as q4, and the ones the file
    keeps finer (attention values, FFN downs) stay at int8."""
    model_type, extra = GGUF[name]
    if kind.startswith("Q4_K"):
        extra = dict(extra, hidden_size=256, intermediate_size=512, head_dim=64)
    gguf_file = write_gguf(
        build(model_type, extra, tmp_path / "hf"), tmp_path / "gguf" / f"tiny-{name}.{kind}.gguf", kind
    )
    # transformers' GGUF loading, with the head size it does not read from a Qwen3 file (worker/loader.py)
    dequantized = load_model(resolve_model(str(gguf_file)), torch.bfloat16, str(tmp_path / "reference-cache"))
    reference = generate(dequantized.eval(), PROMPTS)
    config = replace(
        CONFIG, dtype="auto", cache_dir=str(tmp_path / "cache")
    )  # bf16, or float32 where bf16 is not native
    runner = ModelRunner(resolve_model(str(gguf_file)), config)
    assert runner.quantization == "q4" and runner.paths.fused.any_batch
    if kind == "Q4_K_M":
        weights = dict(zip(SLOTS, runner.paths.fused.weights))  # layer 0's
        kinds = {slot: weights[f"{slot}_w"].dtype for slot in ("qkv", "o", "up", "down")}
        assert kinds == {"qkv": torch.int8, "o": torch.uint8, "up": torch.uint8, "down": torch.int8}
    got = run(Engine(runner, config), PROMPTS, logprobs=5)
    assert all(check_close(g, r)[0] for g, r in zip(got, reference))


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_unsupported_families_are_refused_at_load_by_name(name, tmp_path):
    model_type, extra, why = REFUSED[name]
    build(model_type, extra, tmp_path)
    with pytest.raises(support.UnsupportedModel, match=f"model type '{model_type}'.*is not supported: .*{why}"):
        ModelRunner(resolve_model(str(tmp_path)), CONFIG)


@pytest.mark.parametrize(
    ("name", "why"), [("lfm2", "layers 0 of 2 .conv. never call attention"), ("bloom", "does not go through")]
)
def test_the_start_up_probe_refuses_what_the_table_does_not_name(name, why, tmp_path, monkeypatch):
    """A model type nobody put on the table is refused all the same, by what its forward does."""
    model_type, extra, _ = REFUSED[name]
    build(model_type, extra, tmp_path)
    monkeypatch.delitem(support.REFUSED, model_type)
    with pytest.raises(support.UnsupportedModel, match=why):
        ModelRunner(resolve_model(str(tmp_path)), CONFIG)


def test_the_self_check_refuses_a_path_that_drops_the_sliding_window(tmp_path, monkeypatch):
    """With the window ignored (what the worker did before), the check names the architecture, the
    layer and its window, and the override flag; with the flag, the worker starts."""
    model_type, extra = SERVED["mistral"]
    build(model_type, extra, tmp_path)
    monkeypatch.setattr(LayerSpec, "plain", property(lambda layer: True))
    with pytest.raises(support.UnsupportedModel) as refused:
        ModelRunner(resolve_model(str(tmp_path)), CONFIG)
    message = str(refused.value)
    assert (
        "MistralForCausalLM" in message
        and "self-check" in message
        and f"sliding window {WINDOW}" in message
        and "--skip-self-check" in message
    )
    assert ModelRunner(resolve_model(str(tmp_path)), replace(CONFIG, skip_self_check=True)).num_blocks > 0


@pytest.mark.skipif(DEVICE != "cpu" or not kernels.load(), reason="int8 weights are the CPU's C++ step's")
def test_auto_int8_weights_that_fail_the_self_check_give_way_to_the_models_own(tmp_path, monkeypatch, caplog):
    """Where only the rounding of ``--quantization auto``'s int8 weights fails the check (a random
    Granite of 8 layers, hidden 1,024 and its default attention multiplier of 1 does: its sharp
    attention flips tokens; here the rounding is made worse by hand), the C++ step serves the bf16
    weights and the worker starts; an explicit ``--quantization int8`` is still refused."""
    from worker.models import fused_decode

    def coarse(weight):  # int8 whose scales are 3x off: what a too-coarse rounding does to the logits
        q, scale = quantize_int8(weight)
        scale[:, :1] *= 3
        return q, scale

    quantize_int8 = fused_decode.quantize_int8
    monkeypatch.setattr(fused_decode, "quantize_int8", coarse)
    model_type, extra = SERVED["llama"]
    build(model_type, extra, tmp_path / "model")
    config = replace(
        CONFIG, dtype="auto", cache_dir=str(tmp_path / "cache")
    )  # bf16, or float32 where bf16 is not native
    with pytest.raises(support.UnsupportedModel, match="self-check"):
        ModelRunner(resolve_model(str(tmp_path / "model")), replace(config, quantization="int8"))
    runner = ModelRunner(resolve_model(str(tmp_path / "model")), config)
    assert runner.quantization == "none" and runner.paths.fast, "the C++ step, on the model's own weights"
    assert "int8 weights fail the self-check" in caplog.text


def test_quantized_weights_are_refused_where_the_path_has_none(tmp_path):
    """--quantization int8 on a model the C++ decode step does not run was ignored while the log
    said "weights int8"; now it is refused, naming why."""
    model_type, extra = SERVED["gpt2"]
    build(model_type, extra, tmp_path)
    why = "model type 'gpt2'" if DEVICE == "cpu" else "not on the CPU"  # the step is the CPU's
    with pytest.raises(
        ValueError,
        match=f"--quantization int8 sets the weights of the C\\+\\+ decode step, which cannot run here: {why}",
    ):
        ModelRunner(resolve_model(str(tmp_path)), replace(CONFIG, quantization="int8"))


def test_context_length_from_any_config_field_or_a_stated_default():
    assert support.max_model_len(SimpleNamespace(n_positions=1024), 0) == 1024
    assert support.max_model_len(SimpleNamespace(max_seq_len=300), 100) == 100
    assert support.max_model_len(SimpleNamespace(), 0) == support.DEFAULT_CONTEXT
    assert support.max_model_len(SimpleNamespace(), 9000) == 9000  # no limit known: the flag decides


def test_rotary_scaling_that_depends_on_the_batch_caps_the_context():
    """longrope/dynamic frequencies follow the largest position of the forward pass: exact only below it."""
    config = SimpleNamespace(
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "longrope", "original_max_position_embeddings": 1024},
    )
    assert support.max_model_len(config, 0) == 1024
    with pytest.raises(support.UnsupportedModel, match="longrope"):
        support.max_model_len(config, 2048)
