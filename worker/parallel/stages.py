"""Pipeline parallel: each stage keeps a run of the decoder layers, and hands the hidden state on.

Stage ``s`` of ``M`` runs layers ``[first, end)`` (``bounds``: an even split, the extra layers to
the last stages, because stage 0's rank 0 also schedules and samples). Every rank keeps the model's
whole structure, embeddings, norm and head; each layer it does not run becomes a ``Relay``, a
module that stands in the layer list where that layer was, so transformers' classes and the
native forward run their own loop unchanged (and a layer's index still names its KV cache):

- the relay just before a stage's layers receives the hidden state from the previous stage;
- the relay just after them sends it to the next stage, then receives the final hidden state;
- the last stage sends its final hidden state to every earlier stage, from a hook on the final
  norm (``End``): every stage ends each forward with the whole model's last hidden state, so the
  head's logits, rank 0's sampling and the start-up self-check are the same on every rank;
- the other relays pass their input through.

No micro-batches overlap the stages: a step runs through them one after another (correctness
first; on CPUs replicas beat any split, docs/parallel.md). With ``--tensor-parallel-size`` T too,
stage ``s`` is ranks ``s*T .. s*T+T-1``, each of which sends to the rank of the same tensor share
in the next stage. Each stage's paged cache holds its own layers only (the others' are empty
tensors), and the ranks agree on the smallest block count (``fewest``), since rank 0's block
tables address every stage's cache.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from worker.parallel import shard

Wire = Callable[[], object]  # the process group the hidden states travel on now (start-up's, then the steps')


def bounds(layers: int, stages: int) -> list[tuple[int, int]]:
    """Each stage's ``(first, end)`` layers: ``layers // stages`` each, one more for the last
    ``layers % stages`` stages."""
    if stages > layers:
        raise ValueError(f"--pipeline-parallel-size {stages} exceeds the model's {layers} decoder layers")
    base, extra = divmod(layers, stages)
    sizes = [base + (s >= stages - extra) for s in range(stages)]
    starts = [sum(sizes[:s]) for s in range(stages)]
    return [(start, start + size) for start, size in zip(starts, sizes)]


class Relay(torch.nn.Module):
    """Stands for a layer another stage runs: optionally sends its input to rank ``send_to``, then
    optionally returns what rank ``receive_from`` sends instead (same shape and dtype)."""

    relay = True  # the native forward (worker/models/llama.py) calls it in its layer loop as is

    def __init__(self, wire: Wire, send_to: int | None = None, receive_from: int | None = None) -> None:
        super().__init__()
        self.wire, self.send_to, self.receive_from = wire, send_to, receive_from

    def forward(self, hidden_states: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        import torch.distributed as dist

        if self.send_to is not None:
            dist.send(hidden_states.contiguous(), self.send_to, group=self.wire())
        if self.receive_from is not None:
            hidden_states = torch.empty_like(hidden_states)
            dist.recv(hidden_states, self.receive_from, group=self.wire())
        return hidden_states


class End(torch.nn.Module):
    """The last stage's final hidden state, sent to the same tensor share of every earlier stage."""

    def __init__(self, wire: Wire, peers: list[int]) -> None:
        super().__init__()
        self.wire, self.peers = wire, peers

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        hidden_states = hidden_states.contiguous()
        for peer in self.peers:
            dist.send(hidden_states, peer, group=self.wire())
        return hidden_states


def cut(model: torch.nn.Module, stage: int, stages: int, tensor: int, rank: int, wire: Wire) -> tuple[int, int]:
    """Replace the layers stage ``stage`` does not run with relays (see the module docstring), in
    place; returns the ``(first, end)`` layers it keeps."""
    kind = model.config.model_type
    if not shard.planned(model.config):  # their decoders are model.model.layers (hidden state in and out), then .norm
        raise ValueError(
            f"--pipeline-parallel-size {stages}: model type {kind!r} has no stage plan here "
            "(the families of the tensor split's plan, worker/parallel/shard.py); serve it with --pipeline-parallel-size 1"
        )
    decoder = model.model
    layers = decoder.layers
    first, end = bounds(len(layers), stages)[stage]
    last = (stages - 1) * tensor + rank % tensor  # the rank of this share in the last stage
    for index in range(len(layers)):
        if first <= index < end:
            continue
        relay = Relay(wire)
        if index == first - 1:
            relay.receive_from = rank - tensor
        if index == end:
            relay.send_to, relay.receive_from = rank + tensor, last
        layers[index] = relay  # the layer's weights go with it
    if stage == stages - 1 and stages > 1:
        decoder.norm.pipeline_end = End(wire, [s * tensor + rank % tensor for s in range(stages - 1)])
        decoder.norm.register_forward_pre_hook(lambda norm, args: (norm.pipeline_end(args[0]),))
    return first, end
