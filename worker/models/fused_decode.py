"""The C++ decode step's copy of a model: its weights in the kernel's slots (int8, q4 or the model's
dtype), and one call per step for any number of rows (worker/kernels/decode_step.cpp).

The model is read by ``worker.models.family.describe``; the quantized weights are made once per
model and layout and kept in the conversion cache (``cached_tensors``): 1.35 s to make for the
default model on one core, 0.06 s to read. On a CPU with VNNI, int8 and q4 weights are packed for
its GEMM kernels, which beat oneDNN's bf16 matmuls at every batch size measured (``any_batch``);
otherwise the kernel's matrix-vector loops are for a few rows.
"""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import replace
from pathlib import Path

import torch

from worker import kernels
from worker import quantization as quantization_module
from worker.loader import cached_tensors
from worker.lora.adapter import Segments, step_arguments
from worker.models import family as family_module
from worker.models import measure, shapes
from worker.models.family import describe
from worker.models.measure import halve, rotary_tables
from worker.models.shapes import QK_NONE, Family, Layer, Norm, NotFast
from worker.quantization import OFF_GRID, fit_q4, on_4bit_grid, pack_int8, pack_q4, quantize_int8

# Per-layer slots, in the order of decode_step.cpp's Slot enum.
SLOTS = (
    "attn_norm_w", "attn_norm_b", "qkv_w", "qkv_scale", "qkv_bias", "q_norm", "k_norm", "o_w", "o_scale", "o_bias",
    "post_attn_norm_w", "post_attn_norm_b", "mlp_norm_w", "mlp_norm_b", "up_w", "up_scale", "up_bias", "down_w", "down_scale",
    "down_bias", "post_mlp_norm_w", "post_mlp_norm_b", "router_w", "shared_gate_w",
)  # fmt: skip


class FusedDecode:
    """``__call__`` runs one step of ``[rows]`` single tokens (each with its own position, block
    table and context length) and returns float32 logits ``[rows, vocab]`` (or of the ``keep`` rows)."""

    def __init__(
        self,
        model: torch.nn.Module,
        quantization: str = "none",
        cache: Path | None = None,
        family: Family | None = None,
    ) -> None:
        """``family``: the model as ``describe`` read it earlier (its layers may have gone to the native forward since)."""
        if not kernels.load():
            raise RuntimeError(f"the fused decode step needs the C++ kernels: {kernels.unavailable_reason()}")
        self.family = family or describe(model)
        self.decoder = family_module.text_decoder(model)  # an image-text model's language model
        self.embed = self.decoder.embed_tokens
        self.ops = kernels.ops()
        self.packed = quantization in ("int8", "q4")  # every variant has packed int8 GEMMs (worker/kernels/packed.cpp)
        self.quantization = quantization
        tensors = cached_tensors(
            _cache_folder(cache, quantization, self.packed),
            lambda: _layout(self.family, model, quantization, self.packed),
        )
        layers = len(self.family.layers)
        self.weights = [tensors.get(f"w.{i}.{name}") for i in range(layers) for name in SLOTS]
        self.weights += [tensors["final_norm_w"], tensors.get("final_norm_b")]
        count = sum(1 for name in tensors if name.startswith("e.") and name.endswith(".up_w"))
        self.experts = [
            tensors.get(f"e.{e}.{part}") for e in range(count) for part in ("up_w", "up_scale", "down_w", "down_scale")
        ]
        self.takes_lora = not count  # adapters' products go into dense MLPs (worker/lora adapts no experts)
        self.lm_head, self.lm_head_scale = tensors["lm_head"], tensors.get("lm_head_scale")
        self.ints, self.floats = _numbers(self.family)
        self.family = _without_matrices(self.family)
        matrices = [
            t for name, t in tensors.items() if name.endswith(("qkv_w", "o_w", "up_w", "down_w")) or name == "lm_head"
        ]
        # The packers leave a shape they cannot block (int8: N % 16 or K % 64; q4: N % 16) in the
        # row layout, whose matrix-vector loops are slower than the torch path beyond a few rows.
        self.any_batch = self.packed and all(t.dim() == 4 for t in matrices)
        # The rotary rows read from a table, where the model's depend on the position alone.
        self.rope = RopeRows.of(self)

    def _rope(self, positions: torch.Tensor) -> torch.Tensor:
        """The step's rotary rows ``[sets, rows, 2, rot]`` (cos, sin) at ``positions``, from the model's own module."""
        f = self.family
        like = torch.empty(0, dtype=torch.float32, device=positions.device)
        tables = [rotary_tables(self.decoder, like, positions.unsqueeze(0), kind) for kind in f.rope_types]
        if f.halved:
            tables = [(halve(cos), halve(sin)) for cos, sin in tables]
        return torch.stack([torch.stack([cos[0], sin[0]], dim=1) for cos, sin in tables]).float().contiguous()

    def own_copies(self) -> None:
        """Copy every weight into memory of its own, off any file it was read from (the conversion
        cache's file is mapped; its mapping stays while one tensor of it lives)."""
        self.weights = [None if t is None else t.clone() for t in self.weights]
        self.experts = [None if t is None else t.clone() for t in self.experts]
        self.lm_head = self.lm_head.clone()
        self.lm_head_scale = None if self.lm_head_scale is None else self.lm_head_scale.clone()

    @torch.inference_mode()
    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        lengths: torch.Tensor,
        keep: torch.Tensor | None = None,
        lora: Segments | None = None,
    ) -> torch.Tensor:
        """``lora``: the rows of LoRA adapters (worker/lora), whose products the step adds."""
        f = self.family
        hidden = self.embed(input_ids)
        if f.embed_multiplier != 1.0:
            hidden = hidden * f.embed_multiplier
        rope = self.rope.rows(positions) if self.rope is not None else self._rope(positions)
        adapters, segments = step_arguments(lora, len(f.layers)) if lora else ([], [])
        normed = self.ops.decoder_step(
            hidden, rope, self.weights, self.experts, self.ints, self.floats, [k for k, _ in kv_caches], [v for _, v in kv_caches],
            slots, block_tables, lengths, adapters, segments,
        )  # fmt: skip
        if keep is not None:
            normed = normed[keep]
        logits = self.ops.linear(normed, self.lm_head, self.lm_head_scale, f.lm_head_bias)
        if f.logit_multiplier != 1.0:
            logits = logits * f.logit_multiplier
        if f.final_softcap:
            logits = torch.tanh(logits / f.final_softcap) * f.final_softcap
        return logits


class RopeRows:
    """The step's rotary rows read from a table of every position, not computed again each step (a
    dozen torch ops in the model's rotary module: about a tenth of a ms of a 3 ms step at one row).

    Only for rotary kinds whose tables depend on the position alone; the table is checked at start
    against the model's own module, row for row to the bit, or not used (``of`` gives None).
    """

    STATIC = frozenset({"default", "linear", "llama3"})  # not dynamic NTK or longrope: they read the batch's length

    def __init__(self, fused: FusedDecode) -> None:
        self._compute = fused._rope
        self.table = fused._rope(torch.arange(1024))  # [sets, positions, 2, rot]; grows on demand

    @classmethod
    def of(cls, fused: FusedDecode) -> RopeRows | None:
        kind = getattr(getattr(fused.decoder, "rotary_emb", None), "rope_type", None)
        if fused.family.rope_types != [None] or kind not in cls.STATIC:
            return None
        rows = cls(fused)
        probe = torch.tensor([0, 1, 5, 127, 128, 1023, 3000])
        alone = torch.cat([fused._rope(probe[i : i + 1]) for i in range(len(probe))], dim=1)
        return (
            rows if torch.equal(rows.rows(probe), alone) and torch.equal(rows.rows(probe), fused._rope(probe)) else None
        )

    def rows(self, positions: torch.Tensor) -> torch.Tensor:
        top = int(positions.max()) if positions.numel() else 0
        if top >= self.table.shape[1]:
            self.table = self._compute(torch.arange(max(2 * self.table.shape[1], top + 1)))
        return self.table.index_select(1, positions)


def supports(model: torch.nn.Module) -> str | None:
    """None when the fused step can run ``model``; else why not."""
    try:
        describe(model)
    except NotFast as exc:
        return str(exc)
    return None


def _without_matrices(f: Family) -> Family:
    """The description without its weight matrices, once the step has its own copies: the model's
    tensors it refers to (and the stacked gate/up copies it made) would otherwise stay alive, and
    the file they were mapped from with them."""
    layers = [
        replace(layer, qkv=[], o=None, up=None, down=None, experts=[], router=None, shared_gate=None)
        for layer in f.layers
    ]
    return replace(f, layers=layers)


def _numbers(f: Family) -> tuple[list[int], list[float]]:
    """The per-layer integers and floats of decode_step.cpp (LayerInt, LayerFloat, then the shape)."""
    ints: list[int] = []
    floats: list[float] = []
    expert_offset = 0
    for layer in f.layers:
        norm = next(
            n for n in (layer.attn_norm, layer.post_attn_norm, layer.mlp_norm, layer.post_mlp_norm) if n is not None
        )
        eps = {
            n.eps
            for n in (layer.attn_norm, layer.post_attn_norm, layer.mlp_norm, layer.post_mlp_norm, layer.q_norm)
            if n is not None
        }
        kinds = {
            n.kind
            for n in (layer.attn_norm, layer.post_attn_norm, layer.mlp_norm, layer.post_mlp_norm)
            if n is not None
        }
        if len(eps) > 1 or len(kinds) > 1:
            raise NotFast("norms of one layer with different kinds or eps")
        experts = len(layer.experts)
        ints += [
            norm.kind,
            layer.qk_norm,
            layer.rope_set,
            layer.window,
            0,
            layer.act,
            int(layer.gated),
            int(layer.parallel),
        ]
        ints += [experts, layer.top_k, int(layer.norm_top_k), expert_offset]
        expert_offset += experts
        floats += [norm.eps, layer.scale, layer.softcap, f.residual_multiplier]
    ints += [f.heads, f.kv_heads, f.rotary_dim, f.final_norm.kind, int(f.interleaved)]
    floats.append(f.final_norm.eps)
    return ints, floats


class _Layout:
    """Flat names for a safetensors file, gathered in ``out``: ``w.{layer}.{slot}``,
    ``e.{expert}.{part}``, the final norm and the head."""

    def __init__(self, quantization: str, packed: bool, keep_finer: bool) -> None:
        self.quantization, self.packed, self.keep_finer = quantization, packed, keep_finer
        self.out: dict[str, torch.Tensor] = {}
        self.expert = 0

    def int8(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, scale = quantize_int8(weight)
        return pack_int8(q, scale) if self.packed else (q, scale)

    def matrix(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.quantization == "int8":
            return self.int8(weight)
        if self.quantization == "q4":
            q, dm, worst = fit_q4(weight)
            if self.keep_finer and worst > OFF_GRID:
                return self.int8(weight)
            return pack_q4(q, dm) if self.packed else (q, dm)
        return weight.contiguous(), None

    def put(self, prefix: str, name: str, value: torch.Tensor | None) -> None:
        if value is not None:
            self.out[f"{prefix}.{name}"] = value.contiguous()

    def put_matrix(self, prefix: str, name: str, weight: torch.Tensor | None) -> None:
        if weight is not None:
            w, scale = self.matrix(weight)
            self.put(prefix, f"{name}_w", w)
            self.put(prefix, f"{name}_scale", scale)

    def put_norm(self, prefix: str, name: str, norm: Norm | None) -> None:
        if norm is not None:
            self.put(prefix, f"{name}_w", norm.weight)
            self.put(prefix, f"{name}_b", norm.bias)

    def layer(self, p: str, layer: Layer) -> None:
        for name in ("attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm"):
            self.put_norm(p, name, getattr(layer, name))
        for name, weight in (("qkv", torch.cat(layer.qkv)), ("o", layer.o), ("up", layer.up), ("down", layer.down)):
            self.put_matrix(p, name, weight)
        for name in ("qkv_bias", "o_bias", "up_bias", "down_bias"):
            self.put(p, name, getattr(layer, name))
        if layer.qk_norm != QK_NONE:
            self.put(p, "q_norm", layer.q_norm.weight)
            self.put(p, "k_norm", layer.k_norm.weight)
        self.put(p, "router_w", layer.router)
        self.put(p, "shared_gate_w", layer.shared_gate)
        for gate_up, down in layer.experts:
            self.put_matrix(f"e.{self.expert}", "up", gate_up)
            self.put_matrix(f"e.{self.expert}", "down", down)
            self.expert += 1


def _layout(f: Family, model: torch.nn.Module, quantization: str, packed: bool) -> dict[str, torch.Tensor]:
    """The model's decode weights laid out for the C++ step (``_Layout``)."""
    # A 4-bit file keeps some matrices finer (llama.cpp's Q4_K_M: attention values and some FFN
    # downs in Q6_K): from such a model those stay at int8 rather than being rounded onto 4 bits.
    layout = _Layout(quantization, packed, quantization == "q4" and on_4bit_grid(model))
    for i, layer in enumerate(f.layers):
        layout.layer(f"w.{i}", layer)
    out = layout.out
    out["final_norm_w"] = f.final_norm.weight.contiguous()
    if f.final_norm.bias is not None:
        out["final_norm_b"] = f.final_norm.bias.contiguous()
    # The head (tied to the embeddings in small models) is int8 under q4 too: GGUF files keep it at
    # 8 bits (Q8_0 in the default model), and 4 bits there cost the most accuracy per byte saved.
    head = model.lm_head.weight.detach()
    out["lm_head"], scale = layout.int8(head) if quantization != "none" else (head.contiguous(), None)
    if scale is not None:
        out["lm_head_scale"] = scale
    return out


def _cache_folder(cache: Path | None, quantization: str, packed: bool) -> Path | None:
    """Where one model's decode weights in this layout are kept: the folder names the quantization
    and a digest of the code that lays them out, so a change to it never reads an old layout;
    older layouts of the same kind are removed."""
    if cache is None or quantization == "none":  # unquantized weights are the model's own: nothing to keep
        return None
    sources = [Path(m.__file__) for m in (family_module, measure, shapes, quantization_module)] + [Path(__file__)]
    code = hashlib.sha256(b"".join(p.read_bytes() for p in sources)).hexdigest()[:12]
    kind = f"{quantization}-{'packed' if packed else 'rows'}"
    for old in cache.glob(f"{kind}-*"):
        if old.name != f"{kind}-{code}":
            shutil.rmtree(old, ignore_errors=True)
    return cache / f"{kind}-{code}"
