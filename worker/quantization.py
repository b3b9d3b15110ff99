"""Weight-only quantization for the small-batch decode kernel (``--quantization``).

int8 with one float32 scale per output row (symmetric, round to nearest): half the bytes of bf16,
which is what a batch-1 decode step is bound by; the kernel multiplies in float32 and applies the
scale once per output. Accuracy on the default model is in README's "Quantization" section.
"""

from __future__ import annotations

import torch

CHOICES = ("auto", "none", "int8")


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` -> (int8 ``[N, K]``, float32 scale ``[N]``) with ``weight ~ int8 * scale[:, None]``."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scale.unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()
