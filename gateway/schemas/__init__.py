"""The bodies on the wire, as msgspec Structs (decoding checks the types, unknown fields are
ignored (and logged: gateway/http/fields.py), and Litestar's OpenAPI document describes each one). No behaviour: the routes decode them
and the core reads the sampling fields.

A room beside http/ and generate/, not under http/: the core takes a body's sampling fields as they
came (``CoreRequest.sampling`` is a ``SamplingOptions``; validation, structured outputs and decisions
read it), so schemas under http/ would make generate import http. They import no other gateway room
(tests/test_layout.py holds both).

chat.py       OpenAI chat and completions, and the sampling fields every dialect shares
responses.py  OpenAI's Responses API, requests, responses and stream events
anthropic.py  Anthropic's Messages API
pooling.py    embeddings, rerank and score
tokens.py     vLLM's token-in/token-out bodies (generate, render, derender, abort)
decisions.py  OpenAI's Decisions API
"""
