"""vLLM's closeness rule through the SDK: a reference model's greedy chat reply and the server's,
each as token texts with the top 5 at every position (bench.accuracy.check_close compares them)."""

from __future__ import annotations

import torch

from bench.accuracy import Generation


def reference_reply(model: torch.nn.Module, tokenizer, messages: list[dict], max_tokens: int) -> Generation:
    """``model``'s greedy reply to the chat, as token texts, with its top 5 at each position."""
    from gateway.generate.logprobs import TokenTexts

    texts = TokenTexts(tokenizer)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    with torch.inference_mode():
        result = model.generate(
            torch.tensor([ids]),
            max_new_tokens=max_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    out = result.sequences[0, len(ids) :].tolist()
    top = [step[0].float().topk(5).indices.tolist() for step in result.logits]
    return Generation([texts.bytes(t) for t in out], [], [[texts.bytes(t) for t in row] for row in top])


def served_reply(response) -> Generation:  # an openai ChatCompletion asked with logprobs=True, top_logprobs=5
    entries = response.choices[0].logprobs.content
    return Generation(
        [bytes(e.bytes) for e in entries], [], [[bytes(t.bytes) for t in e.top_logprobs] for e in entries]
    )
