"""One LoRA adapter read from its folder (peft's ``adapter_config.json`` and
``adapter_model.safetensors``) into the shape the native forward adds it in: per layer, the A
matrices of the projections that share an input stacked into one, and their B matrices (times the
adapter's scale) laid block-diagonally over the fused output (worker/models/llama.py and the C++ step,
worker/kernels/decode_step.cpp, fuse q/k/v and gate/up). So each adapted group of projections costs
two matmuls per row group, whatever it targets.

Everything an adapter could hold that this cannot apply exactly (DoRA, trained biases, embedding or
head adapters, modules saved whole, per-module ranks) is refused by name rather than ignored.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

# Fused groups of the native forward: (name, projections in output order, module of the input).
GROUPS = (
    ("qkv", ("q_proj", "k_proj", "v_proj")),
    ("o", ("o_proj",)),
    ("gate_up", ("gate_proj", "up_proj")),
    ("down", ("down_proj",)),
)
TARGETS = tuple(p for _, projs in GROUPS for p in projs)
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[^.]+)?\.weight$")


class AdapterError(ValueError):
    """An adapter this worker cannot serve (the message says why, naming the adapter)."""


@dataclass(frozen=True, slots=True)
class Dims:
    """The base model's projection shapes: (inputs, outputs) of each target, and its layer count."""

    shapes: dict[str, tuple[int, int]]
    num_layers: int

    @classmethod
    def of(cls, config: object) -> Dims:
        hidden, inter = config.hidden_size, config.intermediate_size
        heads, kv = config.num_attention_heads, config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        q, k = heads * head_dim, kv * head_dim
        shapes = {
            "q_proj": (hidden, q),
            "k_proj": (hidden, k),
            "v_proj": (hidden, k),
            "o_proj": (q, hidden),
            "gate_proj": (hidden, inter),
            "up_proj": (hidden, inter),
            "down_proj": (inter, hidden),
        }
        return cls(shapes, config.num_hidden_layers)


@dataclass(slots=True)
class GroupWeights:
    """One fused group of one layer: ``x @ a.T @ bt`` is the group's whole delta (scale in ``bt``)."""

    a: torch.Tensor  # [sum of ranks, inputs]
    bt: torch.Tensor  # B transposed: [sum of ranks, fused outputs], block-diagonal, zero for untargeted ones


@dataclass(slots=True)
class Adapter:
    """An adapter's weights, ready to add: ``layers[i][group]`` or None where layer i has none."""

    name: str
    path: str
    rank: int
    layers: list[dict[str, GroupWeights]]

    @property
    def nbytes(self) -> int:
        return sum(g.a.nbytes + g.bt.nbytes for layer in self.layers for g in layer.values())


def read_config(name: str, path: str, max_rank: int) -> dict:
    """The adapter's config, checked for what the worker can apply; raises AdapterError."""
    folder = Path(path)
    config_file = folder / "adapter_config.json"
    if not config_file.is_file() or not (folder / "adapter_model.safetensors").is_file():
        raise AdapterError(
            f"LoRA adapter `{name}`: {path} must be a folder holding adapter_config.json and adapter_model.safetensors"
        )
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"LoRA adapter `{name}`: cannot read {config_file}: {exc}") from None
    refused = {
        "peft_type": config.get("peft_type", "LORA") != "LORA",
        "use_dora": bool(config.get("use_dora")),
        "bias": config.get("bias", "none") != "none",
        "modules_to_save": bool(config.get("modules_to_save")),
        "rank_pattern": bool(config.get("rank_pattern")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
    }
    bad = [f"`{key}` = {config.get(key)!r}" for key, no in refused.items() if no]
    if bad:
        raise AdapterError(f"LoRA adapter `{name}`: this worker cannot apply {', '.join(bad)}")
    rank = int(config.get("r", 8))
    if rank > max_rank:
        raise AdapterError(
            f"LoRA adapter `{name}` has rank {rank}, more than this worker's --max-lora-rank ({max_rank})"
        )
    return config


def load_adapter(name: str, path: str, dims: Dims, max_rank: int, dtype: torch.dtype, device: torch.device) -> Adapter:
    """Read and check the adapter's files; raises AdapterError for anything it cannot apply."""
    config = read_config(name, path, max_rank)
    rank = int(config.get("r", 8))
    alpha = float(config.get("lora_alpha", rank))
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    try:
        tensors = load_file(str(Path(path) / "adapter_model.safetensors"))
    except Exception as exc:
        raise AdapterError(f"LoRA adapter `{name}`: cannot read adapter_model.safetensors: {exc}") from None
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None or match.group(2) not in TARGETS:
            raise AdapterError(
                f"LoRA adapter `{name}` holds `{key}`, which this worker cannot apply (it adapts {', '.join(TARGETS)})"
            )
        layer, proj, which = int(match.group(1)), match.group(2), match.group(3)
        if layer >= dims.num_layers:
            raise AdapterError(f"LoRA adapter `{name}` adapts layer {layer}; the model has {dims.num_layers}")
        found.setdefault((layer, proj), {})[which] = tensor
    if not found:
        raise AdapterError(f"LoRA adapter `{name}` holds no LoRA weights")
    layers: list[dict[str, GroupWeights]] = [{} for _ in range(dims.num_layers)]
    for index in range(dims.num_layers):
        for group, projs in GROUPS:
            pairs = [found.get((index, p)) for p in projs]
            if any(pairs):
                layers[index][group] = _group(name, projs, pairs, dims, scale, dtype, device)
    return Adapter(name, path, rank, layers)


def _group(
    name: str,
    projs: tuple[str, ...],
    pairs: list[dict[str, torch.Tensor] | None],
    dims: Dims,
    scale: float,
    dtype: torch.dtype,
    device: torch.device,
) -> GroupWeights:
    """Stack the group's A matrices; lay its B matrices block-diagonally over the fused outputs."""
    inputs = dims.shapes[projs[0]][0]
    a_parts, b_blocks = [], []
    for proj, pair in zip(projs, pairs):
        if pair is None:
            continue
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"LoRA adapter `{name}`: {proj} has lora_{''.join(pair)} without its pair")
        a, b = pair["A"].float(), pair["B"].float()
        want_in, want_out = dims.shapes[proj]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != want_in or b.shape[0] != want_out or a.shape[0] != b.shape[1]:
            raise AdapterError(
                f"LoRA adapter `{name}`: {proj} has A {tuple(a.shape)} and B {tuple(b.shape)}; "
                f"this model's {proj} takes {want_in} inputs to {want_out} outputs (is it an adapter of another model?)"
            )
        a_parts.append(a)
        b_blocks.append((proj, b * scale))
    ranks = sum(a.shape[0] for a in a_parts)
    outputs = sum(dims.shapes[p][1] for p in projs)
    b_full = torch.zeros(outputs, ranks)
    row = col = 0
    blocks = dict(b_blocks)
    for proj in projs:
        out = dims.shapes[proj][1]
        if proj in blocks:
            b = blocks[proj]
            b_full[row : row + out, col : col + b.shape[1]] = b
            col += b.shape[1]
        row += out
    a_full = torch.cat(a_parts)
    assert a_full.shape == (ranks, inputs)
    return GroupWeights(a_full.to(device, dtype).contiguous(), b_full.T.to(device, dtype).contiguous())


Segments = list[tuple[Adapter, int, int]]  # (adapter, first row, end row) of a step's flat sequence or rows


def step_arguments(segments: Segments, num_layers: int) -> tuple[list[torch.Tensor | None], list[int]]:
    """The C++ step's ``lora`` and ``lora_segments`` (worker/kernels/decode_step.cpp, struct Lora):
    each distinct adapter's A and B per layer and group (None where it has none), and (first row,
    end row, adapter index) triples."""
    order: dict[int, int] = {}
    weights: list[torch.Tensor | None] = []
    triples: list[int] = []
    for adapter, start, end in segments:
        if id(adapter) not in order:
            order[id(adapter)] = len(order)
            for layer in range(num_layers):
                for group, _ in GROUPS:
                    found = adapter.layers[layer].get(group)
                    weights += (None, None) if found is None else (found.a, found.bt)
        triples += (start, end, order[id(adapter)])
    return weights, triples


def add_delta(segments: Segments, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
    """Add each row group's low-rank product to the fused projection's output ``out`` ([1, T, F]),
    in place: ``out[rows] += (x[rows] @ A.T) @ B.T`` for the rows of each adapter (SGMV's segments,
    as two matmuls per segment: a step holds few adapters, and their rows are contiguous)."""
    for adapter, start, end in segments:
        weights = adapter.layers[layer].get(group)
        if weights is not None:
            out[0, start:end].addmm_(x[0, start:end] @ weights.a.T, weights.bt)
