"""Every dialect's bodies are typed: an OpenAPI document built from the routes describes each
request and (non-streamed) response. The server does not serve the document (no /schema pages);
this builds it offline, as a client generator would."""

from litestar import Litestar
from litestar.di import Provide
from litestar.openapi import OpenAPIConfig

from gateway.routes.chat import ChatController
from gateway.routes.completions import CompletionsController
from gateway.routes.messages import MessagesController
from gateway.routes.responses import ResponsesController

ROUTES = {
    "/v1/chat/completions": ("ChatCompletionRequest", "ChatCompletion"),
    "/v1/completions": ("CompletionRequest", "Completion"),
    "/v1/responses": ("ResponsesRequest", "ResponseObject"),
    "/v1/messages": ("MessagesRequest", "MessageResponse"),
    "/v1/messages/count_tokens": ("CountTokensRequest", "CountTokensResponse"),
}


def test_each_dialects_request_and_response_bodies_are_in_the_openapi_document():
    app = Litestar(
        route_handlers=[ChatController, CompletionsController, ResponsesController, MessagesController],
        dependencies={"generator": Provide(lambda: None, sync_to_thread=False)},
        openapi_config=OpenAPIConfig(title="llmpool", version="1"),
    )
    document = app.openapi_schema.to_schema()
    for path, (request, response) in ROUTES.items():
        post = document["paths"][path]["post"]
        assert post["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/" + request), path
        assert post["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/" + response), path
    assert {"get", "delete"} <= set(document["paths"]["/v1/responses/{response_id}"])
    for name in ("OutputMessage", "FunctionCallItem", "ToolUseBlock", "TextBlock", "AssistantMessage"):
        assert name in document["components"]["schemas"], name
