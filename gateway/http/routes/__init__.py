"""HTTP routes, one module per API family; each dialect translates its body into the core's request
(gateway/generate/request.py) and the core's events back into its shapes.

chat.py, completions.py       OpenAI's chat and legacy completions dialects
responses.py                  OpenAI's Responses API; responses_input.py (its body into the core's request),
                              response_output.py (the core's events into its items), response_runs.py (stored
                              runs, streams that resume on any gateway), response_items.py (input items, cancel),
                              responses_ws.py (its WebSocket mode)
stream_runs.py                chat, completions and Messages streams that resume on any gateway (Last-Event-ID)
messages.py                   Anthropic's Messages API; messages_input.py (its body into the core's request);
                              messages_cache.py (cache_control: retention, and usage up to the last breakpoint)
conversation_checks.py        what Responses and Messages refuse in a conversation (400 naming the field)
embeddings.py, rerank.py      the pooling dialects (embeddings; rerank and score)
tokenize.py                   /tokenize and /detokenize
tokens_io.py                  vLLM's token-in/token-out endpoints: render, /inference/v1/generate, derender, abort;
                              tokens_parse.py (derender's tool calls and thinking, read as chat reads them)
decisions.py                  OpenAI's Decisions API (/v1/decisions)
models.py                     /v1/models
adapters.py                   vLLM's runtime LoRA load and unload
conversations.py, files.py,   the stored-object APIs (conversations, files, batches)
batches.py
admin_keys.py, usage.py       the operator's routes (managed keys, usage)
health.py                     /health, /ready, /workers, /metrics
ui.py                         the built-in page and its static files
common.py                     what every route shares: JSON and SSE responses, OpenAI's usage block
"""
