"""``python -m bench``: throughput and latency of the streaming OpenAI API at several concurrency levels."""
