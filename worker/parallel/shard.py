"""The split plan: each rank keeps its share of every decoder layer, cut as Megatron-LM cuts it.

- q/k/v and gate/up are split by output rows (column parallel): each rank keeps ``heads / N``
  query heads, ``kv_heads / N`` key/value heads (so its paged cache holds only those: the probe
  learns the shapes from a forward over the cut model) and ``intermediate / N`` MLP columns. With
  fewer key/value heads than ranks, each rank keeps the one key/value head its queries read.
- o and down are split by input columns (row parallel): each rank's product is a partial sum, and
  an all-reduce after them gives every rank the whole hidden state. A bias on them is kept by rank
  0 alone (added once).
- Embeddings, norms and the head stay whole on every rank, so each computes the full logits and
  rank 0 samples from its own.

The cut is made on transformers' modules, in place, before anything else reads them: transformers'
own attention reshapes to ``-1`` heads, so its classes run the cut model unchanged (a forward hook
all-reduces o and down), and the native forward (worker/models/llama.py) takes the cut weights and
each module's ``reduce``. Families whose layers have this shape are listed in ``PLANNED``; any other
is refused in one sentence.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# Model types whose decoder layers are self_attn.{q,k,v,o}_proj and mlp.{gate,up,down}_proj with
# per-head norms at most (Qwen3's q_norm/k_norm act on each head alone).
PLANNED = {"llama", "qwen2", "qwen3", "mistral"}


def refuse_unplanned(model: torch.nn.Module, world: int) -> None:
    """ValueError, in one sentence, for a model the plan cannot cut into ``world`` shares."""
    config = model.config
    kind = config.model_type
    if kind not in PLANNED:
        raise ValueError(
            f"--tensor-parallel-size {world}: model type {kind!r} has no split plan here "
            f"(planned: {', '.join(sorted(PLANNED))}); serve it with --tensor-parallel-size 1"
        )
    for name in ("num_attention_heads", "intermediate_size"):
        value = getattr(config, name)
        if value % world:
            raise ValueError(f"--tensor-parallel-size {world} must divide the model's {name} ({value})")
    kv_heads = config.num_key_value_heads
    if kv_heads % world and world % kv_heads:
        raise ValueError(
            f"--tensor-parallel-size {world} must divide the model's num_key_value_heads ({kv_heads}) or be a multiple of it"
        )


def shard(model: torch.nn.Module, rank: int, world: int, reduce: Callable[[torch.Tensor], None]) -> None:
    """Cut every decoder layer of ``model`` to rank ``rank``'s share (see the module docstring).
    ``reduce`` all-reduces a tensor in place across the ranks."""
    refuse_unplanned(model, world)
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    # Fewer key/value heads than ranks: each rank keeps the one its query heads read (vLLM replicates them too).
    kv_share = (rank, world) if kv_heads % world == 0 else (rank * kv_heads // world, kv_heads)
    with torch.no_grad():
        for block in model.model.layers:
            attn, mlp = block.self_attn, block.mlp
            for linear in (attn.q_proj, mlp.gate_proj, mlp.up_proj):
                _keep_rows(linear, rank, world)
            for linear in (attn.k_proj, attn.v_proj):
                _keep_rows(linear, *kv_share)
            attn.num_key_value_groups = (heads // world) // max(1, kv_heads // world)  # transformers' repeat_kv
            for linear in (attn.o_proj, mlp.down_proj):
                _keep_columns(linear, rank, world)
                linear.reduce = reduce  # the native forward applies it after its own copy of the product
                linear.register_forward_hook(_reduce_output)


def _share(size: int, rank: int, world: int) -> slice:
    step = size // world
    return slice(rank * step, (rank + 1) * step)


def _keep_rows(linear: torch.nn.Linear, rank: int, world: int) -> None:
    part = _share(linear.weight.shape[0], rank, world)
    linear.weight = torch.nn.Parameter(linear.weight[part].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = torch.nn.Parameter(linear.bias[part].clone(), requires_grad=False)
    linear.out_features = linear.weight.shape[0]


def _keep_columns(linear: torch.nn.Linear, rank: int, world: int) -> None:
    part = _share(linear.weight.shape[1], rank, world)
    linear.weight = torch.nn.Parameter(linear.weight[:, part].clone(), requires_grad=False)
    if linear.bias is not None and rank != 0:
        linear.bias = None
    linear.in_features = linear.weight.shape[1]


def _reduce_output(module: torch.nn.Module, inputs: object, output: torch.Tensor) -> None:
    module.reduce(output)
