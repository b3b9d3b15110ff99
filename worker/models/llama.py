"""A lean forward pass for Llama-family models (Llama, SmolLM, Qwen2-style QKV bias) over the paged cache.

Why it exists: at batch 1 a decode step through transformers' module tree spends a third of its time
in Python (about 400 module calls per step for the default model). Here each layer is one fused QKV
projection, one fused gate/up projection and a handful of tensor ops. The arithmetic mirrors
transformers' Llama code op for op (float32 RMSNorm, the same rotary embedding module, the same SDPA
call through ``paged_attention``), and fused projections are bit-identical to separate ones, so
greedy output stays token-identical to ``generate``. Other architectures use transformers' classes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker.attention import AttentionMetadata, paged_attention, triton_rope
from worker.lora.adapter import Segments, add_delta

SUPPORTED = {"llama", "qwen2"}


def supports(model: torch.nn.Module) -> bool:
    """Architectures whose layers match the plain Llama block (no sliding window, SiLU MLP)."""
    config = model.config
    return (
        config.model_type in SUPPORTED
        and getattr(config, "hidden_act", "silu") == "silu"
        and not getattr(config, "use_sliding_window", False)
        and not getattr(config, "mlp_bias", False)
    )


@dataclass(slots=True)
class _Layer:
    """Weights of one decoder block, projections fused; quacks like an attention module for SDPA."""

    layer_idx: int
    num_key_value_groups: int
    input_norm: torch.Tensor
    qkv: _Linear
    o_proj: _Linear
    post_norm: torch.Tensor
    gate_up: _Linear
    down: _Linear
    is_causal: bool = True
    training: bool = False


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm, op for op (float32 statistics, cast back, then scale). On a GPU
    in bf16/fp16, torch's fused kernel instead: one launch for the eight here (decode steps there are
    launch-bound; it scales in float32 before the one cast, a rounding apart)."""
    if x.is_cuda and x.dtype != torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


class _Linear:
    """A projection; on the CPU its weight is pre-packed once for oneDNN instead of on every call.

    Pre-packing makes bf16 projections 1.2-2x faster on the CPU and gives bit-identical results.
    ``reduce``: a tensor-parallel row split's all-reduce of the partial product (worker/parallel/shard.py).
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        reduce: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        self.bias = bias
        self.reduce = reduce
        self.packed = weight.device.type == "cpu" and torch.backends.mkldnn.is_available()
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1) if self.packed else weight.detach()
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.packed:
            out = F.linear(x, self.weight, self.bias)
        else:
            flat = x.reshape(-1, x.shape[-1])
            out = torch.ops.mkldnn._linear_pointwise(flat, self.weight, self.bias, "none", [None], "")
            out = out.view(*x.shape[:-1], self.out_features)
        if self.reduce is not None:
            self.reduce(out)
        return out


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaForward:
    """Holds fused weights taken from a loaded transformers model; ``__call__`` runs one step (the
    torch path: prefill, and every step in float32; decode steps on the CPU run the C++ step of
    worker/models/fused_decode.py, made from the same model before this one takes its layers)."""

    def __init__(self, model: torch.nn.Module) -> None:
        config = model.config
        decoder = model.model
        self.eps = config.rms_norm_eps
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        # From the weights: a tensor-parallel rank holds a share of the heads (worker/parallel/shard.py).
        # A pipeline stage's relays stand for the layers other stages run (worker/parallel/stages.py).
        first = next(block for block in decoder.layers if not getattr(block, "relay", False)).self_attn
        self.heads = first.q_proj.weight.shape[0] // self.head_dim
        self.kv_heads = first.k_proj.weight.shape[0] // self.head_dim
        self.embed = decoder.embed_tokens.weight
        self.final_norm = decoder.norm.weight
        self.lm_head = _Linear(model.lm_head.weight)
        self.rotary = decoder.rotary_emb
        self.layers = [
            block if getattr(block, "relay", False) else self._fuse(i, block) for i, block in enumerate(decoder.layers)
        ]
        self.end = getattr(decoder.norm, "pipeline_end", None)  # the last stage's hand-back of the final state
        decoder.layers = torch.nn.ModuleList()  # the fused copies replace them; free the originals

    def _fuse(self, index: int, block: torch.nn.Module) -> _Layer:
        attn, mlp = block.self_attn, block.mlp
        bias = None
        if attn.q_proj.bias is not None:
            bias = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]).detach()
        return _Layer(
            layer_idx=index,
            num_key_value_groups=self.heads // self.kv_heads,
            input_norm=block.input_layernorm.weight.detach().clone(),  # copies: no view keeps the model's file mapped
            qkv=_Linear(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]), bias),
            o_proj=_Linear(
                attn.o_proj.weight,
                None if attn.o_proj.bias is None else attn.o_proj.bias.detach().clone(),  # attention_bias
                getattr(attn.o_proj, "reduce", None),
            ),
            post_norm=block.post_attention_layernorm.weight.detach().clone(),
            gate_up=_Linear(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])),
            down=_Linear(mlp.down_proj.weight, None, getattr(mlp.down_proj, "reduce", None)),
        )

    @torch.inference_mode()
    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        logits_indices: torch.Tensor,
        lora: Segments | None = None,
    ) -> torch.Tensor:
        """``input_ids``/``positions`` are ``[1, num_tokens]``; returns logits of the selected rows.
        ``lora``: row groups whose adapter's low-rank products are added after each adapted projection."""
        hidden = F.embedding(input_ids, self.embed)  # [1, T, hidden]
        cos, sin = self.rotary(hidden, positions)  # [1, T, head_dim]
        num_tokens = input_ids.shape[1]
        fused = metadata.decode_backend.in_place_cuda and not metadata.prefills  # decode rows only, on CUDA
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, _Layer):  # a relay: another pipeline stage runs this layer
                hidden = layer(hidden)
                continue
            x = _rms_norm(hidden, layer.input_norm, self.eps)
            qkv = layer.qkv(x)
            if lora:
                add_delta(lora, i, "qkv", x, qkv)
            attn = (
                self._decode_attention(layer, qkv, cos, sin, metadata)
                if fused
                else self._attention(layer, qkv, cos, sin, metadata)
            ).reshape(1, num_tokens, -1)
            out = layer.o_proj(attn)
            if lora:
                add_delta(lora, i, "o", attn, out)
            hidden = hidden + out
            x = _rms_norm(hidden, layer.post_norm, self.eps)
            gate_up = layer.gate_up(x)
            if lora:
                add_delta(lora, i, "gate_up", x, gate_up)
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up
            out = layer.down(act)
            if lora:
                add_delta(lora, i, "down", act, out)
            hidden = hidden + out
        if self.end is not None:
            hidden = self.end(hidden)
        hidden = _rms_norm(hidden[0, logits_indices], self.final_norm, self.eps)
        return self.lm_head(hidden)

    def _attention(
        self, layer: _Layer, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """Rotary in torch, then ``paged_attention`` (cache writes, decode rows, prompt chunks)."""
        num_tokens = qkv.shape[1]
        qk, v = qkv.split([(self.heads + self.kv_heads) * self.head_dim, self.kv_heads * self.head_dim], dim=-1)
        # Rotary on queries and keys at once: the same arithmetic per element, half the ops.
        qk = qk.view(1, num_tokens, self.heads + self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads: [1, 1, T, head_dim]
        qk = qk * cos + _rotate_half(qk) * sin
        q, k = qk.split([self.heads, self.kv_heads], dim=1)
        v = v.view(1, num_tokens, self.kv_heads, self.head_dim).transpose(1, 2)
        attn, _ = paged_attention(layer, q, k, v, None, scaling=self.head_dim**-0.5, paged_metadata=metadata)
        return attn

    def _decode_attention(
        self, layer: _Layer, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """Decode rows on CUDA: two launches, rotary with the cache writes (worker/attention/triton_rope.py) and
        the paged attention, where the torch path takes about ten (a launch-bound step on a GPU)."""
        k_cache, v_cache = metadata.kv_caches[layer.layer_idx]
        q = triton_rope.rope_and_cache(
            qkv[0], cos[0], sin[0], metadata.slot_mapping, k_cache, v_cache, self.heads, self.kv_heads
        )
        (group,) = metadata.decode_groups
        return metadata.decode_backend(q, k_cache, v_cache, group, self.head_dim**-0.5)
