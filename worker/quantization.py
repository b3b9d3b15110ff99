"""Weight-only quantization for the small-batch decode kernel (``--quantization``).

A batch-1 decode step is bound by the bytes of weights it reads, so fewer bytes per weight is speed:
- int8: one float32 scale per output row (symmetric, round to nearest); half of bf16's bytes.
- q4: 4 bits with a float16 scale and minimum per group of 32 inputs (GGUF's Q4_1 layout, 5 bits a
  weight); a model shipped as Q4_1, like the default one, or as Q4_0 loses nothing to it, since its
  de-quantized weights land back on the same grid. ``auto`` picks it for such models (``on_4bit_grid``).
The kernel multiplies in float32. Accuracy on the default model is in README's "Quantization" section.
"""

from __future__ import annotations

import torch

CHOICES = ("auto", "none", "int8", "q4")
Q4_GROUP = 32


def on_4bit_grid(model: torch.nn.Module, sample: int = 8) -> bool:
    """Whether most of the model's first ``sample`` projections hold at most 16 distinct values in
    every group of 32 inputs: weights de-quantized from a 4-bit file (GGUF Q4_0, Q4_1, Q4_K), which q4
    stores again without loss, while int8's per-row scale would round them once more. Most, not all:
    a Q4_K_M file keeps its attention values (and some FFN downs) in Q6_K."""
    linears = [
        m.weight for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in name
    ][:sample]
    on = [not weight.shape[1] % Q4_GROUP and _distinct_at_most_16(weight) for weight in linears]
    return bool(linears) and 2 * sum(on) > len(on)


def _distinct_at_most_16(weight: torch.Tensor) -> bool:
    groups = weight.detach().float().reshape(-1, Q4_GROUP).sort(dim=-1).values
    return bool((1 + (groups.diff(dim=-1) != 0).sum(dim=-1)).amax() <= 16)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` -> (int8 ``[N, K]``, float32 ``[N, 1 + K / 64]``) with ``weight ~ int8 * scale[:, :1]``.

    Columns after the scale hold each group of 64 inputs' weight sum (when K is a multiple of 64):
    the VNNI kernel shifts int8 activations to unsigned and subtracts these sums back exactly.
    """
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scale.unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
    columns = [scale.unsqueeze(1)]
    if w.shape[1] % 64 == 0:
        columns.append(q.view(w.shape[0], -1, 64).sum(dim=-1, dtype=torch.int32).float())
    return q.contiguous(), torch.cat(columns, dim=1).contiguous()


def pack_int8(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_int8``'s pair in the C++ kernel's VNNI block layout, where the shapes allow it
    (N a multiple of 16, K of 64); otherwise unchanged.

    Weights ``[N / 16, K / 4, 16, 4]``: per block of 16 output rows, 4 consecutive inputs of each
    (one 64-byte load feeds one vpdpbusd). Scales ``[N / 16, 1 + K / 64, 16]``: the block's row
    scales, then each group of 64 inputs' weight sums (see worker/kernels/cpu_ops.cpp, packed_tile).
    """
    n, k = q.shape
    if n % 16 or k % 64 or scale.shape[1] != 1 + k // 64:
        return q, scale
    packed = q.view(n // 16, 16, k // 4, 4).permute(0, 2, 1, 3).contiguous()
    meta = scale.view(n // 16, 16, 1 + k // 64).permute(0, 2, 1).contiguous()
    return packed, meta


def quantize_q4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` -> (uint8 ``[N, K / 2]``, float16 ``[N, K / 32, 2]`` scale and minimum per group).

    Byte j of a group holds q[j] in its low nibble and q[j + 16] in its high one; w ~ d * q + m."""
    packed, dm, _ = fit_q4(weight)
    return packed, dm


def fit_q4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``quantize_q4``'s pair and its largest error, in steps of its group's grid (about 0 when the
    weights were on a 4-bit grid already: de-quantized from a 4-bit file).

    Each group takes whichever grid reproduces it best: Q4_1's (its minimum and maximum 15 steps
    apart), Q4_0's (its value of largest magnitude 8 steps from zero, the grid running 7 steps past
    zero), or, for a group neither reproduces, a grid from its minimum whose span is fewer than 15
    steps (Q4_K's groups: a 6-bit scale and minimum per 32 weights leave the extreme levels unused
    at times). Weights de-quantized from any of these files come back as they were.
    """
    n, k = weight.shape
    if k % Q4_GROUP:
        raise ValueError(f"q4 needs input features in groups of {Q4_GROUP}; this weight has {k}")
    groups = weight.detach().float().view(n, k // Q4_GROUP, Q4_GROUP)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    peak = groups.gather(-1, groups.abs().argmax(dim=-1, keepdim=True)).squeeze(-1)
    best = _on_grid(groups, (high - low) / 15, low)  # Q4_1's grid
    q4_0 = _on_grid(groups, peak.abs() / 8, torch.where(peak < 0, peak, -7 * peak / 8))
    best = _pick(q4_0[3] < best[3] / 2, q4_0, best)  # clearly better: at the weights' own rounding Q4_1's grid stays
    off = (best[3] > _rounding(groups, best[1], best[2], weight.dtype)).nonzero(as_tuple=True)
    if off[0].numel():  # not on the grid the weights are on, at their precision: perhaps a narrower one
        sample = tuple(i[:SAMPLE] for i in off)
        tried = _narrower(groups[sample], low[sample], high[sample], tuple(t[sample] for t in best))
        if (tried[3] <= OFF_GRID * tried[1].float().clamp(min=1e-30)).float().mean() > 0.5:
            found = _narrower(groups[off], low[off], high[off], tuple(t[off] for t in best))
            for whole, part in zip(best, found):
                whole[off] = part
    q, d, m, error = best
    worst = float((error / d.float().clamp(min=1e-30)).amax()) if error.numel() else 0.0
    q = q.to(torch.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)
    return packed.reshape(n, k // 2).contiguous(), torch.stack([d, m], dim=-1).contiguous(), worst


# A group whose largest error is beyond this part of its step is not on that grid. Weights
# de-quantized from a 4-bit file and held in bf16 sit up to ~0.06 of a step off theirs (bf16 keeps 8
# bits of a value up to ~30 steps from zero); weights on no 4-bit grid are off by up to half a step.
OFF_GRID = 0.2


SAMPLE = 64  # off-grid groups tried first: float weights never land on a narrower grid, and the search costs 14 fits


def _narrower(groups: torch.Tensor, low: torch.Tensor, high: torch.Tensor, fit: tuple) -> tuple[torch.Tensor, ...]:
    """``fit``, or where clearly better, a grid from the group's minimum spanning 14 steps or fewer
    (a Q4_K group that leaves its extreme levels unused)."""
    for span in range(14, 0, -1):
        got = _on_grid(groups, (high - low) / span, low)
        fit = _pick(got[3] < fit[3] / 2, got, fit)
    return fit


def _rounding(groups: torch.Tensor, d: torch.Tensor, m: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Twice the error a group on grid (d, m) can show from rounding alone: float16's of the step and
    minimum, and the weights' own dtype's (bf16 keeps 8 bits) of its largest value."""
    half = 2.0**-11
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
    return 2 * (half * (15 * d.float().abs() + m.float().abs()) + eps * groups.abs().amax(dim=-1))


def _on_grid(groups: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(q, d, m as float16, largest error per group) of ``groups`` on the grid ``d * q + m``."""
    d, m = d.half(), m.half()
    step, base = d.float().unsqueeze(-1), m.float().unsqueeze(-1)
    q = torch.where(step > 0, (groups - base) / step.clamp(min=1e-30), 0.0).round_().clamp_(0, 15)
    return q, d, m, (q * step + base - groups).abs().amax(dim=-1)


def _pick(
    better: torch.Tensor, new: tuple[torch.Tensor, ...], old: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, ...]:
    """``new`` where ``better``, else ``old`` (q has one more dimension than the rest)."""
    q = torch.where(better.unsqueeze(-1), new[0], old[0])
    return (q, *(torch.where(better, a, b) for a, b in zip(new[1:3], old[1:3])), torch.where(better, new[3], old[3]))


def pack_q4(packed: torch.Tensor, dm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_q4``'s pair in the C++ kernel's VNNI block layout, where N is a multiple of 16;
    otherwise unchanged.

    Weights ``[N / 16, K / 8, 16, 4]`` uint8: per block of 16 output rows and 8 inputs, byte i of a
    row's 4 holds input i in its low nibble and input 4 + i in its high one (one 64-byte load gives
    two vpdpbusd operands). Scales and minimums ``[N / 16, K / 32, 2, 16]`` float16: one 64-byte line
    per block and group (see worker/kernels/cpu_ops.cpp, packed_q4_tile).
    """
    n = packed.shape[0]
    if n % 16:
        return packed, dm
    nibbles = packed.view(n, -1, Q4_GROUP // 2)
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).view(n // 16, 16, -1, 2, 4)  # [block, row, k/8, half, i]
    blocked = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).permute(0, 2, 1, 3).contiguous()
    meta = dm.view(n // 16, 16, -1, 2).permute(0, 2, 3, 1).contiguous()
    return blocked, meta


def dequantize_q4(packed: torch.Tensor, dm: torch.Tensor) -> torch.Tensor:
    """The float32 ``[N, K]`` weights a q4 pair stands for (tests and accuracy checks)."""
    n = packed.shape[0]
    nibbles = packed.view(n, -1, Q4_GROUP // 2)
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).float()
    return (q * dm[..., 0:1].float() + dm[..., 1:2].float()).reshape(n, -1)
