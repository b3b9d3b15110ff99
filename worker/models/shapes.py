"""The fused decode step's terms for a model (worker/models/family.py fills them in)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

RMS, LAYER = 0, 1
QK_NONE, QK_PER_HEAD, QK_WHOLE = 0, 1, 2
SILU, GELU_TANH, GELU_ERF = 0, 1, 2


class NotFast(ValueError):
    """The model has something the fused step does not do; the message says what."""


@dataclass(slots=True)
class Norm:
    kind: int
    weight: torch.Tensor  # float32, Gemma's 1 + w folded in
    bias: torch.Tensor | None
    eps: float


@dataclass(slots=True)
class Layer:
    attn_norm: Norm | None
    post_attn_norm: Norm | None
    mlp_norm: Norm | None
    post_mlp_norm: Norm | None
    qkv: list[torch.Tensor]  # q, k, v weights (concatenated later)
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    q_norm: Norm | None
    k_norm: Norm | None
    qk_norm: int
    rope_set: int  # -1: no rotary in this layer
    window: int  # 0: none
    scale: float
    softcap: float
    parallel: bool
    act: int
    gated: bool
    up: torch.Tensor | None  # gate and up stacked when gated; the shared expert's in a MoE layer
    up_bias: torch.Tensor | None
    down: torch.Tensor | None
    down_bias: torch.Tensor | None
    experts: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (gate_up, down) per expert
    router: torch.Tensor | None = None
    top_k: int = 0
    norm_top_k: bool = False
    shared_gate: torch.Tensor | None = None


@dataclass(slots=True)
class Family:
    heads: int
    kv_heads: int
    head_dim: int
    rotary_dim: int
    interleaved: bool  # rotary pairs (2i, 2i + 1) rather than (i, i + half)
    halved: bool  # tables as half repeated in pairs (Helium)
    rope_types: list[str | None]  # the rotary table of each rope set (a layer type, or None for the model's one)
    embed_multiplier: float
    residual_multiplier: float
    final_norm: Norm
    logit_multiplier: float
    final_softcap: float
    lm_head_bias: torch.Tensor | None
    layers: list[Layer]
