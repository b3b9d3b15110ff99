"""OpenAI's Batch API behind its route (gateway/http/routes/batches.py) and store (gateway/state/batches.py).

runner.py  each gateway fills the pool's idle capacity with batch requests from the store
lines.py   a batch's lines in and out: the input checked, one request run in-process, its output line
"""
