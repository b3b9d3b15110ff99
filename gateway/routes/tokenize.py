"""POST /tokenize and /detokenize, in vLLM's shapes: what a client needs to count tokens or see
exactly what prompt a chat request becomes (the same template, tools and bounds as chat)."""

from __future__ import annotations

from litestar import Controller, Request, Response, post
from litestar.di import NamedDependency
from litestar.params import JSONBody

from gateway import core
from gateway.errors import InvalidRequest
from gateway.generation import Generator
from gateway.model_registry import ModelRegistry
from gateway.routes.chat import check_request_template, message_dicts
from gateway.routes.common import documented, json_response
from gateway.schemas import DetokenizeRequest, TokenizeRequest
from gateway.tools import tool_plan
from gateway.validation import check_token_ids


async def _tokenize(request: Request, generator: Generator, req: TokenizeRequest) -> list[int]:
    if (req.prompt is None) == (req.messages is None):
        raise InvalidRequest("give exactly one of `prompt` and `messages`", param="prompt")
    if req.prompt is not None:
        generator.check_prompt_size(len(req.prompt), param="prompt")
        return await generator.run_in_pool(generator.text_prompt_ids, req.prompt, req.add_special_tokens is not False, size=len(req.prompt))
    check_request_template(request, req.chat_template)
    plan = tool_plan(req.tools, req.tool_choice, None)
    ids = await core.chat_prompt(
        generator, message_dicts(req.messages or []), plan, req.chat_template, req.chat_template_kwargs, request, req.add_generation_prompt
    )
    if req.add_special_tokens:
        ids = generator.tokenizer.build_inputs_with_special_tokens(ids)
    return ids


class TokenizeController(Controller):
    path = "/"

    @post("/tokenize", status_code=200, responses=documented(None))
    async def tokenize(self, request: Request, data: JSONBody[TokenizeRequest], models: NamedDependency[ModelRegistry]) -> Response:
        req = data
        generator = models.get(req.model)
        ids = await _tokenize(request, generator, req)
        body: dict = {"count": len(ids), "max_model_len": generator.max_model_len(), "tokens": ids}
        if req.return_token_strs:
            body["token_strs"] = generator.tokenizer.convert_ids_to_tokens(ids)
        return json_response(body)

    @post("/detokenize", status_code=200, responses=documented(None))
    async def detokenize(self, data: JSONBody[DetokenizeRequest], models: NamedDependency[ModelRegistry]) -> Response:
        req = data
        generator = models.get(req.model)
        check_token_ids(req.tokens, generator.vocab_size, "tokens")
        text = await generator.run_in_pool(generator.tokenizer.decode, req.tokens, size=len(req.tokens))
        return json_response({"prompt": text})
