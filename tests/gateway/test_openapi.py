"""Every dialect's bodies are typed: the OpenAPI document the server serves (JSON only, at
/schema/openapi.json) describes each request and (non-streamed) response."""

ROUTES = {
    "/v1/chat/completions": ("ChatCompletionRequest", "ChatCompletion"),
    "/v1/completions": ("CompletionRequest", "Completion"),
    "/v1/responses": ("ResponsesRequest", "ResponseObject"),
    "/v1/messages": ("MessagesRequest", "MessageResponse"),
    "/v1/messages/count_tokens": ("CountTokensRequest", "CountTokensResponse"),
}


def test_each_dialects_request_and_response_bodies_are_in_the_served_openapi_document(server):
    response = server.get("/schema/openapi.json")
    assert response.status_code == 200 and "json" in response.headers["content-type"]
    document = response.json()
    assert server.get("/schema").json() == document
    for page in (
        "/schema/swagger",
        "/schema/redoc",
        "/schema/elements",
        "/schema/rapidoc",
    ):  # no pages that load a CDN's scripts
        assert "<script" not in server.get(page).text, page
    assert not any(path.startswith("/schema") for path in document["paths"])
    for path, (request, response) in ROUTES.items():
        post = document["paths"][path]["post"]
        assert post["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/" + request), path
        assert post["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/" + response), path
    assert {"get", "delete"} <= set(document["paths"]["/v1/responses/{response_id}"])
    for name in ("OutputMessage", "FunctionCallItem", "ToolUseBlock", "TextBlock", "AssistantMessage"):
        assert name in document["components"]["schemas"], name


def test_the_routes_declare_bodies_dependencies_and_path_parameters_as_litestar_3_wants():
    """Litestar 2.23+ warns (and 3.0 will refuse) handlers whose ``data``, dependencies or path
    parameters are inferred from bare annotations; building the app must raise none of those."""
    import warnings

    from litestar.exceptions import LitestarWarning
    from litestar.utils.deprecation import LitestarDeprecationWarning

    from gateway.config import GatewayConfig
    from gateway.http.app import create_app

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        create_app(GatewayConfig()).openapi_schema  # builds every handler's signature model
    assert [
        str(w.message) for w in caught if issubclass(w.category, (LitestarDeprecationWarning, LitestarWarning))
    ] == []
