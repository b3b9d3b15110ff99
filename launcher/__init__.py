"""``llmpool``: one command for the gateway, the workers, or both together (``serve``)."""
