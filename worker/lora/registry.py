"""Which adapters a worker serves (registered: a name and a folder) and which of them are resident
(their weights in memory): at most ``--max-loras``, least recently used out first; the others are
read again from their folder when a step needs them. The scheduler never runs more distinct
adapters at once than may be resident (worker/scheduler.py), so a step always finds room."""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict

import torch

from common.lora import LoraCommand, LoraInfo, LoraLoad, LoraResult
from common.protocol import Ready
from worker.lora.adapter import Adapter, AdapterError, Dims, Segments, load_adapter
from worker.request import LoraRef, Request
from worker.scheduler import Scheduler

log = logging.getLogger(__name__)

DEFAULT_MAX_LORAS = 4
DEFAULT_MAX_LORA_RANK = 16  # vLLM's default


def parse_specs(specs: list[str] | None) -> dict[str, str]:
    """``--lora NAME=PATH`` (repeated, or comma-separated in its environment twin) as {name: path}."""
    found: dict[str, str] = {}
    for spec in (part.strip() for item in specs or () for part in item.split(",")):
        if not spec:
            continue
        name, sep, path = spec.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"--lora takes NAME=PATH (a peft adapter folder); got {spec!r}")
        if name.strip() in found:
            raise ValueError(f"--lora names the adapter `{name.strip()}` twice")
        found[name.strip()] = path.strip()
    return found


class LoraRegistry:
    """Registered adapters by name, resident ones in LRU order; the runner's, used by the engine."""

    def __init__(self, config: object, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device) -> None:
        if max_loras < 1:
            raise ValueError(f"--max-loras must be at least 1; got {max_loras}")
        if max_rank < 1:
            raise ValueError(f"--max-lora-rank must be at least 1; got {max_rank}")
        self.dims = Dims.of(config)
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = device
        self.registered: dict[str, LoraRef] = {}
        self.resident: OrderedDict[str, Adapter] = OrderedDict()  # by LoraRef.key, least recently used first
        self.loads = 0  # adapters read from disk, since start
        self._serial = itertools.count(1)

    def register(self, name: str, path: str) -> LoraRef:
        """Check and read the adapter (AdapterError if this worker cannot apply it); resident at once."""
        if name in self.registered:
            raise AdapterError(f"the LoRA adapter `{name}` is already loaded (unload it first to replace it)")
        ref = LoraRef(name, path, f"lora:{name}#{next(self._serial)}")
        self._make_resident(ref, [], load_adapter(name, path, self.dims, self.max_rank, self.dtype, self.device))
        self.registered[name] = ref
        log.info("LoRA adapter %s registered from %s", name, path)
        return ref

    def unregister(self, name: str) -> None:
        """Forget the name: new requests cannot use it; those running with it finish (their
        reference keeps the folder, read again if the weights were evicted)."""
        if self.registered.pop(name, None) is None:
            raise AdapterError(f"the LoRA adapter `{name}` is not loaded")
        log.info("LoRA adapter %s unregistered", name)

    def get(self, name: str) -> LoraRef | None:
        return self.registered.get(name)

    def segments(self, segments: list[tuple[LoraRef, int, int]]) -> Segments:
        """A step's row groups with their weights, reading back any that were evicted (LRU)."""
        wanted = [ref.key for ref, _, _ in segments]
        out = []
        for ref, start, end in segments:
            adapter = self.resident.get(ref.key)
            if adapter is None:
                adapter = load_adapter(ref.name, ref.path, self.dims, self.max_rank, self.dtype, self.device)
                self._make_resident(ref, wanted, adapter)
            self.resident.move_to_end(ref.key)
            out.append((adapter, start, end))
        return out

    def _make_resident(self, ref: LoraRef, keep: list[str], adapter: Adapter) -> None:
        self.loads += 1
        self.resident[ref.key] = adapter
        for key in list(self.resident):
            if len(self.resident) <= self.max_loras:
                break
            if key not in keep and key != ref.key:
                del self.resident[key]
                log.info("LoRA adapter %s evicted (--max-loras %d)", key, self.max_loras)

    def resident_names(self) -> list[str]:
        """Names of the resident adapters still registered, least recently used first."""
        names = {ref.key: name for name, ref in self.registered.items()}
        return [names[key] for key in self.resident if key in names]


def names_of(requests: object) -> list[str]:
    """The distinct adapters of these requests, in order of first appearance."""
    return list(dict.fromkeys(r.lora.name for r in requests if isinstance(r, Request) and r.lora is not None))


def build(
    specs: list[str] | None,
    why_not: str | None,
    config: object,
    max_loras: int,
    max_rank: int,
    dtype: torch.dtype,
    device: torch.device,
) -> LoraRegistry | None:
    """The runner's registry with ``--lora``'s adapters read; None where adapters cannot be applied
    (``why_not`` says why), and then ``--lora`` is refused rather than ignored."""
    adapters = parse_specs(specs)
    if why_not is not None:
        if adapters:
            raise ValueError(f"--lora cannot be used here: {why_not}")
        return None
    registry = LoraRegistry(config, max_loras, max_rank, dtype, device)
    for name, path in adapters.items():
        registry.register(name, path)
    return registry


def lora_load(registry: LoraRegistry, scheduler: Scheduler) -> LoraLoad:
    """A heartbeat's LoRA figures: adapters of running and waiting requests, the resident ones."""
    return LoraLoad(
        names_of(scheduler.running), names_of(scheduler.waiting), registry.resident_names(), registry.max_loras
    )


def lora_info(registry: LoraRegistry | None) -> LoraInfo | None:
    """What ``Ready`` says of the adapters (None: this worker cannot apply any)."""
    if registry is None:
        return None
    return LoraInfo({name: ref.path for name, ref in registry.registered.items()}, registry.max_loras)


def answer(registry: LoraRegistry | None, command: LoraCommand, ready: Ready) -> LoraResult:
    """Carry out a gateway's load or unload (between two steps) and keep ``ready`` current, so a
    gateway that connects later learns the adapters served now. Loading the same folder under the
    same name again is a success, and so is unloading a name it does not serve: each gateway of a
    fleet may send the same command (gateway/fleet/lora.py brings every worker to the fleet's set)."""
    name, path = command.name, command.path
    try:
        if registry is None:
            raise AdapterError("this worker cannot apply LoRA adapters (they need the native forward)")
        if command.unload:
            if registry.get(name) is not None:
                registry.unregister(name)
        elif registry.get(name) is None or registry.get(name).path != path:
            registry.register(name, path)
    except AdapterError as exc:
        return LoraResult(command.token, name, str(exc), path, command.unload)
    except Exception as exc:  # a file that breaks the reader: the adapter's fault, not the worker's
        log.exception("LoRA adapter %s from %s", name, path)
        return LoraResult(command.token, name, f"LoRA adapter `{name}`: {type(exc).__name__}: {exc}", path)
    ready.lora = lora_info(registry)
    return LoraResult(command.token, name, None, path, command.unload)
