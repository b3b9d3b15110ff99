"""State that outlives a gateway: stored Responses (and their event logs), conversations, files,
batches, managed keys and usage, on SQLite (embedded, the default) or PostgreSQL (shared by a fleet
of gateways). Nothing here imports the rest of the gateway but its errors.

db.py             the driver layer over SQLite and PostgreSQL
migrations.py     the schema, as numbered migrations every gateway applies at start
service.py        the store as the app holds it, and its heartbeat (leases, takeovers, usage flushes)
store.py          stored responses, scoped to the key that created them
records.py        what the store keeps of a response, and whose it is
writer.py         the group commits that keep writes off the token path
runs.py           responses running here whose events are logged
leases.py         which gateway runs which response, so another can take over
aborts.py         request ids /abort_requests asked to stop, read by every gateway's heartbeat
limits.py         what a stored body may hold
conversations.py  the Conversations API's storage
files.py          files' rows; file_store.py: where their bytes live (database, directory, S3)
batches.py        batches and their requests
keys.py           managed API keys; windows.py: what they used per minute and month, fleet-wide
adapters.py       the runtime LoRA adapters per model, the fleet's one record
usage.py          tokens per key, model and day
"""
