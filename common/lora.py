"""LoRA adapters on the wire: the gateway's commands to load or unload one (vLLM's
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``, sent to every worker of the model) and
the workers' answers. A request names its adapter in ``NewRequest.lora``; a worker lists the
adapters it serves in ``Ready.loras`` and which run, wait and are resident in its heartbeats.
"""

from __future__ import annotations

import msgspec


class LoraCommand(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Gateway -> worker: serve the adapter in folder ``path`` as ``name``, or stop serving it
    (``unload``); answered with a ``LoraResult`` carrying the same ``token``."""

    token: int
    name: str
    path: str = ""
    unload: bool = False


class LoraResult(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Worker -> gateway: how a ``LoraCommand`` ended (``error`` None: done)."""

    token: int
    name: str
    error: str | None = None
    path: str = ""
    unload: bool = False


class LoraInfo(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A worker's ``Ready``: the adapters it serves (``--lora``, and any loaded since), name -> folder."""

    adapters: dict[str, str] = {}
    max_loras: int = 0  # most resident at once (and running in one step)


class LoraLoad(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A worker's heartbeat: the adapters of its running and of its waiting requests (vLLM's
    ``lora_requests_info`` gauge), and those resident now (the gateway prefers a worker holding one)."""

    running: list[str] = []
    waiting: list[str] = []
    resident: list[str] = []
    max_loras: int = 0
