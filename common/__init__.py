"""What the gateway and the workers must agree on: the wire protocol, shared flags, model location.

Imports only the standard library and msgspec, never torch, zmq or transformers.
"""
