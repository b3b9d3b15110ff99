"""State that outlives a gateway: stored Responses (and their event logs), conversations and usage,
on SQLite (embedded, the default) or PostgreSQL (shared by a fleet of gateways).

``db`` is the driver layer, ``migrations`` the schema, ``store`` the responses, ``writer`` the group
commits that keep writes off the token path, ``runs`` and ``leases`` the streams that survive their
gateway, ``limits`` what a stored body may hold, ``usage`` billing, ``conversations`` the
Conversations API.
"""
