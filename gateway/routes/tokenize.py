"""POST /tokenize and /detokenize, in vLLM's shapes: what a client needs to count tokens or see
exactly what prompt a chat request becomes."""

from __future__ import annotations

from litestar import Controller, Response, post

from gateway.errors import InvalidRequest
from gateway.generation import Generator
from gateway.routes.chat import message_dicts
from gateway.routes.common import check_model, json_response
from gateway.schemas import DetokenizeRequest, TokenizeRequest


def _tokenize(generator: Generator, req: TokenizeRequest) -> list[int]:
    if (req.prompt is None) == (req.messages is None):
        raise InvalidRequest("give exactly one of `prompt` and `messages`", param="prompt")
    if req.prompt is not None:
        return generator.text_prompt_ids(req.prompt, req.add_special_tokens is not False)
    ids = generator.chat_prompt_ids(message_dicts(req.messages or []), None, req.chat_template_kwargs, req.add_generation_prompt)
    if req.add_special_tokens:
        ids = generator.tokenizer.build_inputs_with_special_tokens(ids)
    return ids


class TokenizeController(Controller):
    path = "/"

    @post("/tokenize", status_code=200)
    async def tokenize(self, data: TokenizeRequest, generator: Generator) -> Response:
        req = data
        if req.model is not None:
            check_model(req.model, generator.model_name)
        ids = await generator.run_in_pool(_tokenize, generator, req)
        body: dict = {"count": len(ids), "max_model_len": generator.max_model_len(), "tokens": ids}
        if req.return_token_strs:
            body["token_strs"] = generator.tokenizer.convert_ids_to_tokens(ids)
        return json_response(body)

    @post("/detokenize", status_code=200)
    async def detokenize(self, data: DetokenizeRequest, generator: Generator) -> Response:
        req = data
        if req.model is not None:
            check_model(req.model, generator.model_name)
        if not all(0 <= t < generator.vocab_size for t in req.tokens):
            raise InvalidRequest(f"`tokens` must be token ids from 0 to {generator.vocab_size - 1}", param="tokens")
        text = await generator.run_in_pool(generator.tokenizer.decode, req.tokens)
        return json_response({"prompt": text})
