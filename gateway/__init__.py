"""The gateway: OpenAI-compatible HTTP API, chat templates, tokens and text; reaches workers over ZeroMQ.

Its rooms, one job each; imports point one way, http -> generate -> fleet, with policy, state,
schemas and ops beside them (tests/test_layout.py holds it, and that no module import circles):

http/       the web side: the Litestar app, its routes (one module per dialect or resource),
            request limits, server-sent events
schemas/    the bodies on the wire as msgspec Structs, per dialect (read by http/ and generate/)
generate/   the core every dialect speaks through: checks, templates, tokenizer, stop strings,
            tools, reasoning, logprobs, structured outputs, events; the pooling core beside it
fleet/      the workers: dispatch, roster, their records, recovery, the ROUTER socket, LoRA placement
policy/     who may run what and when: API keys, priority, admission and its fair queue, quotas
batch/      the Batch API's runner and its lines in and out
state/      what outlives a gateway: stored responses, conversations, files, batches, keys, usage
ops/        what an operator reads: Prometheus metrics, OpenTelemetry traces

config.py   the gateway's settings (flags and their environment twins)
errors.py   one error hierarchy, in OpenAI's and Anthropic's body shapes
__main__.py ``python -m gateway``: the HTTP server and the socket workers connect to
"""
