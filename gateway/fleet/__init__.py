"""The workers as the gateway sees them: who serves, which one runs each request, what becomes of
it when that worker fails. Only worker_client.py holds a socket.

worker_client.py  the ROUTER socket: reads the workers' messages, sends what dispatch decided
dispatch.py       which worker runs each request (no sockets; decisions go to an outbox)
recovery.py       a request whose worker failed: resumed elsewhere, or an orphan for a liveness period
roster.py         the workers registered per model, those still joining, and why any left
workers.py        the records: each worker, each model's workers, each request in flight, prefix affinity
lora.py           LoRA adapters: which workers serve which, the load and unload commands, placement
"""
