"""A lean forward pass for Llama-family models (Llama, SmolLM, Qwen2-style QKV bias) over the paged cache.

Why it exists: at batch 1 a decode step through transformers' module tree spends a third of its time
in Python (about 400 module calls per step for the default model). Here each layer is one fused QKV
projection, one fused gate/up projection and a handful of tensor ops. The arithmetic mirrors
transformers' Llama code op for op (float32 RMSNorm, the same rotary embedding module, the same SDPA
call through ``paged_attention``), and fused projections are bit-identical to separate ones, so
greedy output stays token-identical to ``generate``. Other architectures use transformers' classes.
"""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F

from worker import kernels
from worker import quantization as quantization_module
from worker.attention import AttentionMetadata, paged_attention, triton_rope
from worker.loader import cached_tensors
from worker.quantization import pack_int8, pack_q4, quantize_int8, quantize_q4

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
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.bias = bias
        self.packed = weight.device.type == "cpu" and torch.backends.mkldnn.is_available()
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1) if self.packed else weight.detach()
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.packed:
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(-1, x.shape[-1])
        out = torch.ops.mkldnn._linear_pointwise(flat, self.weight, self.bias, "none", [None], "")
        return out.view(*x.shape[:-1], self.out_features)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass(slots=True)
class DecodeWeights:
    """The weights ``torch.ops.llmpool.llama_decode`` reads, per layer in lists: plain contiguous
    matrices (int8 with a float32 scale per output row, q4 with float16 group scales and minimums,
    or the model's dtype with no scales), float32 norms and biases."""

    input_norms: list[torch.Tensor]
    qkv: list[torch.Tensor]
    qkv_scale: list[torch.Tensor]
    qkv_bias: list[torch.Tensor]
    o_proj: list[torch.Tensor]
    o_scale: list[torch.Tensor]
    post_norms: list[torch.Tensor]
    gate_up: list[torch.Tensor]
    gate_up_scale: list[torch.Tensor]
    down: list[torch.Tensor]
    down_scale: list[torch.Tensor]
    final_norm: torch.Tensor
    lm_head: torch.Tensor
    lm_head_scale: torch.Tensor | None

    def tensors(self) -> dict[str, torch.Tensor]:
        """Flat names (``qkv.3``, ``lm_head``) for a safetensors file; ``from_tensors`` reverses it."""
        flat = {}
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, list):
                flat.update((f"{field.name}.{i}", t) for i, t in enumerate(value))
            elif value is not None:
                flat[field.name] = value
        return flat

    @classmethod
    def from_tensors(cls, flat: dict[str, torch.Tensor]) -> DecodeWeights:
        values = {}
        for field in fields(cls):
            if field.type.startswith("list"):
                count = sum(name.rsplit(".", 1)[0] == field.name for name in flat)
                values[field.name] = [flat[f"{field.name}.{i}"] for i in range(count)]
            else:
                values[field.name] = flat.get(field.name)
        return cls(**values)


def _decode_weights(model: torch.nn.Module, quantization: str, packed: bool) -> DecodeWeights:
    """Fused (and, with ``int8`` or ``q4``, quantized) copies of the weights for the decode kernel;
    ``packed``: in the VNNI block layouts (worker/quantization.py: pack_int8, pack_q4)."""

    def int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, scale = quantize_int8(weight)
        return pack_int8(q, scale) if packed else (q, scale)

    def matrix(*parts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        weight = torch.cat([p.detach() for p in parts]) if len(parts) > 1 else parts[0].detach()
        if quantization == "int8":
            return int8(weight)
        if quantization == "q4":
            return pack_q4(*quantize_q4(weight)) if packed else quantize_q4(weight)
        return weight.contiguous(), None

    w = DecodeWeights(*([] for _ in range(11)), final_norm=model.model.norm.weight.detach().float(), lm_head=None, lm_head_scale=None)
    for block in model.model.layers:
        attn, mlp = block.self_attn, block.mlp
        for target, scales, parts in (
            (w.qkv, w.qkv_scale, (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)),
            (w.o_proj, w.o_scale, (attn.o_proj.weight,)),
            (w.gate_up, w.gate_up_scale, (mlp.gate_proj.weight, mlp.up_proj.weight)),
            (w.down, w.down_scale, (mlp.down_proj.weight,)),
        ):
            weight, scale = matrix(*parts)
            target.append(weight)
            if scale is not None:
                scales.append(scale)
        if attn.q_proj.bias is not None:
            w.qkv_bias.append(torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]).detach().float())
        w.input_norms.append(block.input_layernorm.weight.detach().float())
        w.post_norms.append(block.post_attention_layernorm.weight.detach().float())
    # The head (tied to the embeddings in small models) is int8 under q4 too: GGUF files keep it at
    # 8 bits (Q8_0 in the default model), and 4 bits there cost the most accuracy per byte saved.
    head = model.lm_head.weight.detach()
    w.lm_head, w.lm_head_scale = int8(head) if quantization != "none" else (head.contiguous(), None)
    return w


def _decode_cache(cache: Path | None, quantization: str, packed: bool) -> Path | None:
    """Where one model's decode weights in this layout are kept: the folder names the quantization
    and a digest of the code that lays them out (this file and worker/quantization.py), so a change
    to either never reads an old layout; older layouts of the same kind are removed."""
    if cache is None or quantization == "none":  # unquantized weights are the model's own: nothing to keep
        return None
    code = hashlib.sha256(Path(__file__).read_bytes() + Path(quantization_module.__file__).read_bytes()).hexdigest()[:12]
    kind = f"{quantization}-{'packed' if packed else 'rows'}"
    for old in cache.glob(f"{kind}-*"):
        if old.name != f"{kind}-{code}":
            shutil.rmtree(old, ignore_errors=True)
    return cache / f"{kind}-{code}"


def _all_packed(w: DecodeWeights) -> bool:
    """Every projection in a packed block layout (4-D), so the GEMM kernels take any batch."""
    return all(t.dim() == 4 for t in (*w.qkv, *w.o_proj, *w.gate_up, *w.down, w.lm_head))


class LlamaForward:
    """Holds fused weights taken from a loaded transformers model; ``__call__`` runs one step.

    With ``fast_decode`` it also keeps the weights the C++ decode kernel reads (``decode``): a whole
    decode step in one call, with int8 or q4 weights when ``quantization`` says so. On a CPU with
    VNNI those are packed for its GEMM kernels, which beat oneDNN's bf16 matmuls at every batch size
    measured (``decode_any_batch``); otherwise the kernel's matrix-vector loops are for a few rows.
    """

    def __init__(self, model: torch.nn.Module, fast_decode: bool = False, quantization: str = "none", cache: Path | None = None) -> None:
        config = model.config
        decoder = model.model
        self.eps = config.rms_norm_eps
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.embed = decoder.embed_tokens.weight
        self.final_norm = decoder.norm.weight
        self.lm_head = _Linear(model.lm_head.weight)
        self.rotary = decoder.rotary_emb
        packed = fast_decode and quantization in ("int8", "q4") and kernels.has_vnni()
        self.decode_weights = None
        if fast_decode:  # made once per model and layout, then read from ``cache`` (see _decode_cache)
            build = lambda: _decode_weights(model, quantization, packed).tensors()  # noqa: E731
            self.decode_weights = DecodeWeights.from_tensors(cached_tensors(_decode_cache(cache, quantization, packed), build))
        # The packers leave a shape they cannot block (int8: N % 16 or K % 64; q4: N % 16) in the
        # row layout, whose matrix-vector loops are slower than the torch path beyond a few rows.
        self.decode_any_batch = packed and _all_packed(self.decode_weights)
        self.layers = [self._fuse(i, block) for i, block in enumerate(decoder.layers)]
        decoder.layers = torch.nn.ModuleList()  # the fused copies replace them; free the originals

    def _fuse(self, index: int, block: torch.nn.Module) -> _Layer:
        attn, mlp = block.self_attn, block.mlp
        bias = None
        if attn.q_proj.bias is not None:
            bias = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]).detach()
        return _Layer(
            layer_idx=index,
            num_key_value_groups=self.heads // self.kv_heads,
            input_norm=block.input_layernorm.weight.detach(),
            qkv=_Linear(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]), bias),
            o_proj=_Linear(attn.o_proj.weight),
            post_norm=block.post_attention_layernorm.weight.detach(),
            gate_up=_Linear(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])),
            down=_Linear(mlp.down_proj.weight),
        )

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        """``input_ids``/``positions`` are ``[1, num_tokens]``; returns logits of the selected rows."""
        hidden = F.embedding(input_ids, self.embed)  # [1, T, hidden]
        cos, sin = self.rotary(hidden, positions)  # [1, T, head_dim]
        num_tokens = input_ids.shape[1]
        fused = metadata.decode_backend.in_place_cuda and not metadata.prefills  # decode rows only, on CUDA
        for layer in self.layers:
            x = _rms_norm(hidden, layer.input_norm, self.eps)
            qkv = layer.qkv(x)
            attn = self._decode_attention(layer, qkv, cos, sin, metadata) if fused else self._attention(layer, qkv, cos, sin, metadata)
            hidden = hidden + layer.o_proj(attn.reshape(1, num_tokens, -1))
            x = _rms_norm(hidden, layer.post_norm, self.eps)
            gate, up = layer.gate_up(x).chunk(2, dim=-1)
            hidden = hidden + layer.down(F.silu(gate) * up)
        hidden = _rms_norm(hidden[0, logits_indices], self.final_norm, self.eps)
        return self.lm_head(hidden)

    def _attention(self, layer: _Layer, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
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

    def _decode_attention(self, layer: _Layer, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Decode rows on CUDA: two launches, rotary with the cache writes (worker/attention/triton_rope.py) and
        the paged attention, where the torch path takes about ten (a launch-bound step on a GPU)."""
        k_cache, v_cache = metadata.kv_caches[layer.layer_idx]
        q = triton_rope.rope_and_cache(qkv[0], cos[0], sin[0], metadata.slot_mapping, k_cache, v_cache, self.heads, self.kv_heads)
        (group,) = metadata.decode_groups
        return metadata.decode_backend(q, k_cache, v_cache, group, self.head_dim**-0.5)

    @torch.inference_mode()
    def decode(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        lengths: torch.Tensor,
        max_len: int,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One step of ``[rows]`` single tokens (each with its own position, block table and context
        length) through the C++ kernel; float32 logits ``[rows, vocab]``, or of the ``keep`` rows."""
        w = self.decode_weights
        hidden = F.embedding(input_ids, self.embed)
        cos, sin = self.rotary(hidden.new_empty(0, dtype=torch.float32), positions.unsqueeze(0))
        normed = torch.ops.llmpool.llama_decode(
            hidden,
            cos[0],
            sin[0],
            w.input_norms,
            w.qkv,
            w.qkv_scale,
            w.qkv_bias,
            w.o_proj,
            w.o_scale,
            w.post_norms,
            w.gate_up,
            w.gate_up_scale,
            w.down,
            w.down_scale,
            w.final_norm,
            [k for k, _ in kv_caches],
            [v for _, v in kv_caches],
            slots,
            block_tables,
            lengths,
            max_len,
            self.heads,
            self.kv_heads,
            self.eps,
            self.head_dim**-0.5,
        )
        if keep is not None:
            normed = normed[keep]
        return torch.ops.llmpool.linear(normed, w.lm_head, w.lm_head_scale, None)
