"""Who may run what, and when: checked before a request reaches the fleet.

auth.py        API keys (--api-key, --admin-key, managed keys) and the caller's owner digest
priority.py    a request's priority and who decides it (--scheduling-policy)
admission.py   backpressure: slots at the workers and a bounded wait, else 429
fair_queue.py  the admission queue, fair between API keys
quotas.py      managed keys' limits: models, monthly tokens, generations in flight, per-minute rates
"""
