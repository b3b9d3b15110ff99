"""The web side of the gateway: everything that knows Litestar or HTTP.

app.py           create_app(config) -> Litestar: the services (dependency injection), routes, guards, errors
auth.py          the API-key guards, the Caller record each route hands the core (``caller_of``), rate headers
server.py        uvicorn with httptools, plus the limits uvicorn lacks (header and body sizes, timeouts), and a
                 shutdown that lets WebSockets end their responses first
request_body.py  request bodies checked for nesting depth before they are decoded
fields.py        request fields no API defines: logged once and counted, or refused (--strict-fields)
streaming.py     server-sent events: OpenAI's ``data:`` frames and [DONE], named events for Responses and Messages
routes/          one module per API dialect or resource (gateway/http/routes/__init__.py lists them)
static/          the built-in page's files (playground and dashboard)
"""
