"""Who may run what, and when: checked before a request reaches the fleet. Nothing here knows the
web framework: a request's caller comes as a ``Caller`` record.

caller.py      Caller: who made a request (owner, managed key, request id, address, a hang-up signal); RateInfo
rules.py       Rules: the server's own rules for every request (scheduling policy, templates, quotas, usage)
auth.py        API keys (--api-key, --admin-key, managed keys) and whose a caller's stored objects are
priority.py    a request's priority and who decides it (--scheduling-policy)
admission.py   backpressure: slots at the workers and a bounded wait, else 429
fair_queue.py  the admission queue, fair between API keys
quotas.py      managed keys' limits: models, monthly tokens, generations in flight, per-minute rates
"""
