"""The worker: owns the model and the KV cache, schedules its own steps (continuous batching)."""
