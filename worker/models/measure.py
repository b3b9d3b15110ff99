"""Measurements that tell how a model computes what its config does not say: which norm (RMS, with
``1 + w`` or not, or LayerNorm), which activation, how rotary pairs its dims, and whether an MLP read
from the model computes what the module does. Each runs the model's own module on random inputs
against the candidates, so a family that differs is refused (``NotFast``) rather than served wrong.
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.nn.functional as F

from worker.models.shapes import GELU_ERF, GELU_TANH, LAYER, RMS, SILU, Layer, Norm, NotFast


def rotary_tables(
    decoder: torch.nn.Module, like: torch.Tensor, positions: torch.Tensor, layer_type: str | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own cos/sin at ``positions`` ``[1, T]`` (any rope variant, its scaling included)."""
    if layer_type is None:
        return decoder.rotary_emb(like, positions)
    return decoder.rotary_emb(like, positions, layer_type)


def rope_layout(attn: torch.nn.Module, decoder: torch.nn.Module, rope_type: str | None, rot: int) -> tuple[bool, bool]:
    """How the attention's module applies its rotary tables, measured against its own
    ``apply_rotary_pos_emb``: (interleaved: pairs (2i, 2i + 1) rather than (i, i + half), halved:
    the first half of each table repeated in pairs, as Helium does)."""
    apply = getattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb", None)
    if apply is None:
        raise NotFast(f"{type(attn).__name__}: no apply_rotary_pos_emb to measure")
    positions = torch.arange(5, 12).unsqueeze(0)
    cos, sin = rotary_tables(decoder, torch.zeros(1, dtype=torch.float32), positions, rope_type)
    x = torch.randn(
        1, 2, positions.shape[1], rot, generator=torch.Generator().manual_seed(3)
    )  # the rotated part of a head
    want, _ = apply(x, x, cos, sin)
    for interleaved in (False, True):
        for halved in (False, True):
            got = rotate(x, *(halve(t) if halved else t for t in (cos, sin)), rot, interleaved)
            if torch.allclose(got, want, atol=1e-5):
                return interleaved, halved
    raise NotFast(f"{type(attn).__name__}: rotary applied in a way the fused step does not know")


def halve(table: torch.Tensor) -> torch.Tensor:
    return table[..., : table.shape[-1] // 2].repeat_interleave(2, dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: int, interleaved: bool) -> torch.Tensor:
    """The fused step's rotary (decode_step.cpp ``rotary``) in torch: ``x`` [b, heads, T, D], tables [b, T, rot]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    part, rest = x[..., :rot], x[..., rot:]
    if interleaved:
        pairs = part.unflatten(-1, (-1, 2))
        turned = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    else:
        half = rot // 2
        turned = torch.cat((-part[..., half:], part[..., :half]), dim=-1)
    return torch.cat((part * cos + turned * sin, rest), dim=-1)


def activation(fn: torch.nn.Module, where: str) -> int:
    """Which activation ``fn`` computes, measured on random inputs."""
    x = torch.randn(256, generator=torch.Generator().manual_seed(0)) * 3
    got = fn(x)
    candidates = {SILU: F.silu(x), GELU_TANH: F.gelu(x, approximate="tanh"), GELU_ERF: F.gelu(x)}
    for code, want in candidates.items():
        if torch.allclose(got, want, atol=1e-5, rtol=1e-5):
            return code
    raise NotFast(f"{where}: activation {type(fn).__name__} is none of SiLU, GELU (tanh), GELU (erf)")


def norm(module: torch.nn.Module | None, where: str) -> Norm:
    """The norm's kind, measured on a copy with random weights: RMS (``w`` or ``1 + w``) or LayerNorm."""
    if module is None:
        raise NotFast(f"{where}: missing")
    weight = getattr(module, "weight", None)
    bias = getattr(module, "bias", None)
    eps = getattr(module, "variance_epsilon", None) or getattr(module, "eps", None) or getattr(module, "epsilon", None)
    if weight is None or eps is None:
        raise NotFast(f"{where}: {type(module).__name__} has no weight or eps")
    probe = copy.deepcopy(module).float()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        probe.weight.copy_(torch.randn(probe.weight.shape, generator=generator))
        if getattr(probe, "bias", None) is not None:
            probe.bias.copy_(torch.randn(probe.bias.shape, generator=generator))
    x = torch.randn(3, weight.shape[-1], generator=generator)
    with torch.no_grad():
        got = probe(x)
    w = probe.weight.detach()
    b = None if getattr(probe, "bias", None) is None else probe.bias.detach()
    rms = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    centred = x - x.mean(-1, keepdim=True)
    layer = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + eps) * w + (0 if b is None else b)
    real_w = weight.detach().float()
    if b is None and torch.allclose(got, rms * w, atol=1e-5, rtol=1e-4):
        return Norm(RMS, real_w, None, float(eps))
    if b is None and torch.allclose(got, rms * (1 + w), atol=1e-5, rtol=1e-4):
        return Norm(RMS, 1 + real_w, None, float(eps))
    if torch.allclose(got, layer, atol=1e-5, rtol=1e-4):
        return Norm(LAYER, real_w, None if bias is None else bias.detach().float(), float(eps))
    raise NotFast(f"{where}: {type(module).__name__} is neither an RMS norm nor a LayerNorm")


def check_mlp(mlp: torch.nn.Module, layer: Layer, index: int) -> None:
    """The MLP as read (projections, order of gate and up, activation) against the module itself."""
    dtype = layer.up.dtype
    x = torch.randn(2, layer.up.shape[1], generator=torch.Generator().manual_seed(2)).to(dtype)
    with torch.no_grad():
        want = mlp(x).float()
        h = x.float() @ layer.up.float().T + (0 if layer.up_bias is None else layer.up_bias)
        act = {SILU: F.silu, GELU_TANH: lambda t: F.gelu(t, approximate="tanh"), GELU_ERF: F.gelu}[layer.act]
        if layer.gated:
            gate, up = h.chunk(2, dim=-1)
            h = act(gate) * up
        else:
            h = act(h)
        got = h @ layer.down.float().T + (0 if layer.down_bias is None else layer.down_bias)
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    if not torch.allclose(got, want, atol=tolerance * (1 + want.abs().max().item()), rtol=tolerance):
        raise NotFast(f"layer {index}: the MLP ({type(mlp).__name__}) does not compute what was read from it")
