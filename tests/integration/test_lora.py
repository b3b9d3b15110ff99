"""A LoRA adapter of the default model through the real server (its two workers) and the openai SDK:
loaded at runtime (vLLM's /v1/load_lora_adapter), listed by /v1/models with its parent, picked with
``model=NAME``, its greedy bf16 text close to peft's merged model by vLLM's rule (and not the base
model's), reported in ``vllm:lora_requests_info``, then unloaded; unknown adapters are 404s."""

from __future__ import annotations

import copy

import openai
import pytest
import torch

from tests.conftest import MODEL

NAME = "terse-lora"
ASK = [{"role": "user", "content": "Name three colours of the rainbow."}]


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, gguf_reference):
    """A random rank-8 adapter on every projection (peft leaves B at zero: both drawn at random),
    and peft's merged bf16 model as the reference (on a copy of the session's GGUF model: peft
    changes the model it wraps)."""
    from peft import LoraConfig, get_peft_model

    base = copy.deepcopy(gguf_reference)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=targets))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    folder = tmp_path_factory.mktemp("lora") / NAME
    model.save_pretrained(folder)
    return folder, model.merge_and_unload().eval()


def test_a_runtime_loaded_adapter_serves_close_to_peft_and_unloads(server, client, tokenizer, adapter):
    from bench.accuracy import check_close
    from tests.closeness import reference_reply, served_reply

    folder, merged = adapter
    loaded = server.post("/v1/load_lora_adapter", json={"lora_name": NAME, "lora_path": str(folder)})
    try:
        assert loaded.status_code == 200 and "added successfully" in loaded.text, loaded.text
        again = server.post("/v1/load_lora_adapter", json={"lora_name": NAME, "lora_path": str(folder)})
        assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
        cards = {m.id: m for m in client.models.list().data}
        assert cards[NAME].model_extra["parent"] == MODEL and cards[NAME].model_extra["root"] == str(folder)

        expected = reference_reply(merged, tokenizer, ASK, 24)
        replies = {
            model: client.chat.completions.create(
                model=model, messages=ASK, max_tokens=24, temperature=0, logprobs=True, top_logprobs=5
            )
            for model in (NAME, MODEL)
        }
        got = served_reply(replies[NAME])
        close, where = check_close(expected, got)
        assert close and where >= 4, f"diverged at token {where}: {expected.tokens[where:]!r} vs {got.tokens[where:]!r}"
        assert replies[NAME].choices[0].message.content != replies[MODEL].choices[0].message.content
        assert replies[NAME].model == NAME and replies[MODEL].model == MODEL  # each answer names what it ran
        assert "vllm:lora_requests_info{" in server.get("/metrics").text
        assert any((w["lora"] or {}).get("resident") == [NAME] for w in server.workers())
    finally:
        unloaded = server.post("/v1/unload_lora_adapter", json={"lora_name": NAME})
    assert unloaded.status_code == 200 and "removed successfully" in unloaded.text, unloaded.text
    assert NAME not in {m.id for m in client.models.list().data}
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model=NAME, messages=ASK, max_tokens=4)
    assert missing.value.body["code"] == "model_not_found"
    assert server.post("/v1/unload_lora_adapter", json={"lora_name": NAME}).status_code == 404


def test_an_adapter_the_workers_cannot_read_is_a_400_naming_it(server, tmp_path):
    reply = server.post("/v1/load_lora_adapter", json={"lora_name": "nowhere", "lora_path": str(tmp_path)})
    assert reply.status_code == 400
    assert "`nowhere`" in reply.json()["error"]["message"] and "adapter_config.json" in reply.json()["error"]["message"]
    assert "nowhere" not in {m["id"] for m in server.get("/v1/models").json()["data"]}
