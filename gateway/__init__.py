"""The gateway: OpenAI-compatible HTTP API, chat templates, tokens and text; reaches workers over ZeroMQ."""
