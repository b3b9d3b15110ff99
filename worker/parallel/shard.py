"""The split plan: each rank keeps its share of every decoder layer, cut as Megatron-LM cuts it.

- q/k/v and gate/up are split by output rows (column parallel): each rank keeps ``heads / N``
  query heads, ``kv_heads / N`` key/value heads (so its paged cache holds only those: the probe
  learns the shapes from a forward over the cut model) and ``intermediate / N`` MLP columns. With
  fewer key/value heads than ranks, each rank keeps the one key/value head its queries read.
- o and down are split by input columns (row parallel): each rank's product is a partial sum, and
  an all-reduce after them gives every rank the whole hidden state. A bias on them is kept by rank
  0 alone (added once).
- MoE blocks (transformers' fused experts): each expert is cut as a dense MLP is, the router
  stays whole (every rank routes every token alike), and one all-reduce sums the block's output
  (experts and shared expert together: the shared expert's sigmoid gate scales partial sums alike).
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
# per-head norms at most (Qwen3's q_norm/k_norm act on each head alone), or, for the MoE ones, an
# mlp of transformers' fused experts (gate_up_proj [experts, 2 x inter, hidden], down_proj
# [experts, hidden, inter]) beside a router and perhaps a shared expert.
PLANNED = {"llama", "qwen2", "qwen3", "mistral", "qwen2_moe", "qwen3_moe", "mixtral"}
# transformers' own tensor-parallel plan (a config's ``base_model_tp_plan``) of Llama's cut: a
# family whose plan is this one, with replicated per-head q/k norms at most, is cut alike
# (Gemma, Gemma 2 and 3, Granite, OLMo, Cohere, SmolLM3, Helium, ...).
LLAMA_CUT = {f"layers.*.self_attn.{name}_proj": "colwise" for name in "qkv"} | {
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}
HEAD_NORMS = {"layers.*.self_attn.q_norm", "layers.*.self_attn.k_norm"}


def planned(config: object) -> bool:
    """Whether the split plan cuts this model type: listed, or transformers' own plan for it is Llama's cut."""
    if config.model_type in PLANNED:
        return True
    plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    return {key: way for key, way in plan.items() if key not in HEAD_NORMS} == LLAMA_CUT


def refuse_unplanned(model: torch.nn.Module, world: int) -> None:
    """ValueError, in one sentence, for a model the plan cannot cut into ``world`` shares."""
    config = model.config
    kind = config.model_type
    if not planned(config):
        raise ValueError(
            f"--tensor-parallel-size {world}: model type {kind!r} has no split plan here "
            f"(planned: {', '.join(sorted(PLANNED))}, and families whose transformers tp_plan is Llama's); "
            "serve it with --tensor-parallel-size 1"
        )
    for name in (
        "num_attention_heads",
        "intermediate_size",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
    ):
        value = getattr(config, name, None) or 0
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
            _refuse_whole_norms(attn, heads, world)
            _keep_rows(attn.q_proj, rank, world)
            for linear in (attn.k_proj, attn.v_proj):
                _keep_rows(linear, *kv_share)
            attn.num_key_value_groups = (heads // world) // max(1, kv_heads // world)  # transformers' repeat_kv
            _keep_columns(attn.o_proj, rank, world)
            _reduced(attn.o_proj, reduce)
            if getattr(mlp, "experts", None) is None:
                _cut_mlp(mlp, rank, world)
                _reduced(mlp.down_proj, reduce)
            else:  # MoE: every expert (and the shared one) cut alike, one all-reduce of the block's sum
                _cut_experts(mlp.experts, rank, world)
                if getattr(mlp, "shared_expert", None) is not None:
                    _cut_mlp(mlp.shared_expert, rank, world)  # its sigmoid gate scales the partial sums alike
                _reduced(mlp, reduce)


def _refuse_whole_norms(attn: torch.nn.Module, heads: int, world: int) -> None:
    """q/k norms must act on each head alone (one head's weights): a norm over all heads mixes them."""
    head_dim = attn.q_proj.weight.shape[0] // heads
    for norm in (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)):
        weight = getattr(norm, "weight", None)
        if weight is not None and weight.numel() != head_dim:
            raise ValueError(
                f"--tensor-parallel-size {world}: this model's q/k norms span all heads, which the split plan does not cut"
            )


def _reduced(module: torch.nn.Module, reduce: Callable[[torch.Tensor], None]) -> None:
    """``module``'s output is a partial sum: all-reduce it (a forward hook; the native forward
    applies ``reduce`` after its own copy of the product)."""
    module.reduce = reduce
    module.register_forward_hook(_reduce_output)


def _cut_mlp(mlp: torch.nn.Module, rank: int, world: int) -> None:
    for linear in (mlp.gate_proj, mlp.up_proj):
        _keep_rows(linear, rank, world)
    _keep_columns(mlp.down_proj, rank, world)


def _cut_experts(experts: torch.nn.Module, rank: int, world: int) -> None:
    """Each expert's gate and up rows and down columns, as a dense MLP's (vLLM's tensor-parallel MoE):
    the router runs whole on every rank, so each routes every token alike."""
    if getattr(experts, "is_transposed", False) or getattr(experts, "has_bias", False):
        raise ValueError(
            f"--tensor-parallel-size {world}: these experts' weights (transposed or biased) have no split plan here"
        )
    inter = experts.gate_up_proj.shape[1] // 2
    part = _share(inter, rank, world)
    gate_up = experts.gate_up_proj
    kept = torch.cat([gate_up[:, part], gate_up[:, inter + part.start : inter + part.stop]], dim=1)
    experts.gate_up_proj = torch.nn.Parameter(kept.clone(), requires_grad=False)
    experts.down_proj = torch.nn.Parameter(experts.down_proj[:, :, part].clone(), requires_grad=False)
    experts.intermediate_dim = inter // world


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
