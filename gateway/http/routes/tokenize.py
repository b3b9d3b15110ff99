"""POST /tokenize and /detokenize, in vLLM's shapes: what a client needs to count tokens or see
exactly what prompt a chat request becomes (the same template, tools and bounds as chat)."""

from __future__ import annotations

from litestar import Controller, Response, get, post
from litestar.di import NamedDependency
from litestar.params import FromQuery, JSONBody

from gateway.errors import InvalidRequest
from gateway.generate import core
from gateway.generate.model_registry import ModelRegistry
from gateway.generate.request import CoreRequest
from gateway.generate.validation import check_token_ids
from gateway.http.routes.chat import message_dicts
from gateway.http.routes.common import documented, json_response
from gateway.policy.caller import Caller
from gateway.schemas.chat import DetokenizeRequest, TokenizeRequest


def core_request(req: TokenizeRequest) -> CoreRequest:
    """A prompt, or chat messages with their template and tools, as chat and completions take them."""
    if (req.prompt is None) == (req.messages is None):
        raise InvalidRequest("give exactly one of `prompt` and `messages`", param="prompt")
    if req.prompt is not None:
        return CoreRequest(prompts=[req.prompt], add_special_tokens=req.add_special_tokens is not False)
    return CoreRequest(
        messages=message_dicts(req.messages or []),
        template=req.chat_template,
        template_kwargs=req.chat_template_kwargs,
        add_generation_prompt=req.add_generation_prompt,
        tools=req.tools,
        tool_choice=req.tool_choice,
    )


class TokenizeController(Controller):
    path = "/"

    @post("/tokenize", status_code=200, responses=documented(None))
    async def tokenize(
        self, data: JSONBody[TokenizeRequest], models: NamedDependency[ModelRegistry], caller: NamedDependency[Caller]
    ) -> Response:
        req = data
        served = models.get(req.model)
        (ids,) = await core.prompt_ids(served, core_request(req), caller)
        if req.messages is not None and req.add_special_tokens:  # on top of the template's own
            ids = served.tokenizer.build_inputs_with_special_tokens(ids)
        body: dict = {"count": len(ids), "max_model_len": served.max_model_len(), "tokens": ids}
        if req.return_token_strs:
            body["token_strs"] = served.tokenizer.convert_ids_to_tokens(ids)
        return json_response(body)

    @post("/detokenize", status_code=200, responses=documented(None))
    async def detokenize(self, data: JSONBody[DetokenizeRequest], models: NamedDependency[ModelRegistry]) -> Response:
        req = data
        served = models.get(req.model)
        check_token_ids(req.tokens, served.vocab_size, "tokens")
        text = await served.run_in_pool(served.tokenizer.decode, req.tokens, size=len(req.tokens))
        return json_response({"prompt": text})

    @get("/tokenizer_info", responses=documented(None))
    async def tokenizer_info(
        self, models: NamedDependency[ModelRegistry], model: FromQuery[str | None] = None
    ) -> Response:
        """vLLM's: the tokenizer's class and settings, its special tokens and chat template, so a client
        (lm-eval's remote tokenizer) need not download the tokenizer to count or render."""
        served = models.get(model)
        tokenizer = served.tokenizer
        info = {
            k: v
            for k, v in tokenizer.init_kwargs.items()
            if k not in ("tokenizer_object", "added_tokens_decoder") and _plain(v)
        }
        info |= {name: getattr(tokenizer, name, None) for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
        info |= {
            "tokenizer_class": type(tokenizer).__name__,
            "vocab_size": served.vocab_size,
            "chat_template": served.template.source,
        }
        info["model_max_length"] = served.max_model_len() or info.get("model_max_length")
        return json_response(info)


def _plain(value: object) -> bool:
    """Whether a setting is JSON as it is (a tokenizer's init kwargs also hold objects)."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return isinstance(value, dict) and all(isinstance(k, str) and _plain(v) for k, v in value.items())
