"""Fallback chat templates (``--chat-template NAME``) for models whose tokenizer carries none."""
