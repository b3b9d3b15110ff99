"""worker/parallel without a second process: the topology the flags and torchrun's variables give,
the refusals (sizes, flags, families without a split plan), the split plan's shapes, and a step's
batch as a follower rebuilds it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from common.protocol import SamplingParams
from tests.worker.families import SERVED, family_config
from worker.attention import EagerDecode
from worker.config import WorkerConfig
from worker.parallel import shard, stages, steps
from worker.parallel.topology import refuse, resolve
from worker.request import Request
from worker.runner.inputs import InputBuilder
from worker.scheduler import ScheduledBatch

TP2 = replace(WorkerConfig(), tensor_parallel_size=2)


def test_one_rank_is_no_group_and_two_pick_a_port_and_start_the_other():
    assert resolve(WorkerConfig(), {}) is None
    topology = resolve(TP2, {})
    assert (topology.rank, topology.world, topology.local_world, topology.by_torchrun) == (0, 2, 2, False)
    assert topology.master_port > 0


def test_torchrun_variables_are_honoured_and_must_agree_with_the_sizes():
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    topology = resolve(TP2, env)
    assert (topology.rank, topology.local_rank, topology.master_addr, topology.master_port) == (1, 1, "10.0.0.1", 29500)
    assert topology.by_torchrun and not topology.leader
    with pytest.raises(ValueError, match="WORLD_SIZE=4"):
        resolve(TP2, env | {"WORLD_SIZE": "4"})


def test_nodes_split_the_ranks_and_bad_combinations_are_refused():
    nodes = replace(TP2, tensor_parallel_size=4, nnodes=2, node_rank=1, master_port=29500, headless=True)
    topology = resolve(nodes, {})
    assert (topology.rank, topology.local_world) == (2, 2)
    for bad, phrase in [
        (replace(nodes, master_port=0), "needs --master-port"),
        (replace(nodes, node_rank=0), "--headless is for the other machines"),
        (replace(nodes, nnodes=3), "does not divide"),
        (replace(WorkerConfig(), headless=True), "need --tensor-parallel-size or --pipeline-parallel-size > 1"),
    ]:
        with pytest.raises(ValueError, match=phrase):
            resolve(bad, {})


def test_flags_whose_work_is_not_split_are_refused_in_one_sentence():
    refuse(TP2)
    with pytest.raises(ValueError, match=r"^--lora, --quantization cannot be used with --tensor-parallel-size 2: "):
        refuse(replace(TP2, lora=["a=/x"], quantization="int8"))


def tiny(model_type: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(family_config(model_type, {"attention_bias": True})).eval()


def test_a_family_without_a_split_plan_is_refused_in_one_sentence():
    with pytest.raises(ValueError, match=r"model type 'gpt2' has no split plan here \(planned: llama, "):
        shard.refuse_unplanned(tiny("gpt2"), 2)
    with pytest.raises(ValueError, match="must divide the model's num_attention_heads"):
        shard.refuse_unplanned(tiny("llama"), 8)  # 4 query heads
    with pytest.raises(ValueError, match="must divide the model's num_key_value_heads \\(2\\) or be a multiple"):
        sizes = SimpleNamespace(model_type="llama", num_attention_heads=6, num_key_value_heads=2, intermediate_size=6)
        shard.refuse_unplanned(SimpleNamespace(config=sizes), 3)


def test_the_two_shares_add_up_to_the_whole_layer():
    """Each rank's column shares and its row share's partial product, summed as the all-reduce sums
    them, give the uncut layer's output (up to float rounding)."""
    whole = tiny("llama")
    parts = [tiny("llama") for _ in range(2)]
    for rank, part in enumerate(parts):
        shard.shard(part, rank, 2, lambda tensor: None)
    attn = [p.model.layers[0].self_attn for p in parts]
    assert attn[0].q_proj.weight.shape == (32, 64) and attn[0].k_proj.weight.shape == (16, 64)
    assert attn[1].o_proj.bias is None and attn[0].o_proj.bias is not None  # added once
    x = torch.randn(3, 64)
    mlp = [p.model.layers[0].mlp for p in parts]
    with torch.no_grad():
        summed = sum(m.down_proj(torch.nn.functional.silu(m.gate_proj(x)) * m.up_proj(x)) for m in mlp)
        expected = whole.model.layers[0].mlp(x)
    torch.testing.assert_close(summed, expected)


def test_a_follower_rebuilds_the_steps_flat_sequence_exactly():
    requests = [
        Request(
            "a",
            list(range(10, 30)),
            20,
            8,
            SamplingParams(),
            frozenset(),
            num_computed_tokens=19,
            block_ids=[3, 4, 5, 6, 7],
        ),
        Request(
            "b",
            list(range(40, 60)),
            20,
            8,
            SamplingParams(),
            frozenset(),
            num_computed_tokens=8,
            block_ids=[0, 1, 2, 8, 9],
        ),
    ]
    batch = ScheduledBatch(requests, [1, 8])
    builder = InputBuilder(4, torch.device("cpu"), [], EagerDecode())
    mine, theirs = builder.flat(batch), builder.flat(steps.decode(steps.encode(batch)))
    for name in ("input_ids", "positions", "logits_indices"):
        assert torch.equal(getattr(mine, name), getattr(theirs, name))
    assert torch.equal(mine.metadata.slot_mapping, theirs.metadata.slot_mapping)
    assert [s.block_table.tolist() for s in mine.metadata.prefills] == [
        s.block_table.tolist() for s in theirs.metadata.prefills
    ]


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("world", [2, 4])
def test_the_shares_attention_adds_up_to_the_whole_with_fewer_kv_heads_than_ranks_too(world, model_type):
    """Each rank's attention over its heads (4 ranks: one query head each, sharing the 2 key/value
    heads two by two), o_proj's partial products summed, is the uncut attention."""
    whole = tiny(model_type)
    parts = [tiny(model_type) for _ in range(world)]
    for rank, part in enumerate(parts):
        shard.shard(part, rank, world, lambda tensor: None)
    assert parts[-1].model.layers[0].self_attn.k_proj.weight.shape[0] == 16 * max(1, 2 // world)
    x = torch.randn(1, 5, 64)
    position_ids = torch.arange(5)[None]
    with torch.no_grad():

        def attention(model: torch.nn.Module) -> torch.Tensor:
            embeddings = model.model.rotary_emb(x, position_ids)
            return model.model.layers[0].self_attn(x, embeddings, None)[0]

        summed = sum(attention(part) for part in parts)
        expected = attention(whole)
    torch.testing.assert_close(summed, expected)


def test_stages_split_the_layers_evenly_with_the_extra_ones_last():
    assert stages.bounds(2, 2) == [(0, 1), (1, 2)]
    assert stages.bounds(7, 3) == [(0, 2), (2, 4), (4, 7)]
    with pytest.raises(ValueError, match="--pipeline-parallel-size 3 exceeds the model's 2 decoder layers"):
        stages.bounds(2, 3)
    topology = resolve(replace(TP2, pipeline_parallel_size=2), {"RANK": "3", "WORLD_SIZE": "4"})
    assert (topology.world, topology.stage, topology.share) == (4, 1, 1)


def test_each_stage_keeps_its_layers_and_relays_the_others_between_the_same_tensor_shares():
    """3 stages x 2 tensor shares (ranks 2s, 2s+1), one layer each: stage s receives from the same
    share of stage s-1, sends to stage s+1's, and every earlier stage gets the last one's final state."""

    def cut(rank: int) -> torch.nn.Module:
        model = AutoModelForCausalLM.from_config(family_config("llama", {"num_hidden_layers": 3}))
        assert stages.cut(model, rank // 2, 3, 2, rank, lambda: None) == (rank // 2, rank // 2 + 1)
        return model

    def wiring(model: torch.nn.Module) -> list[tuple[int | None, int | None] | None]:
        return [(m.send_to, m.receive_from) if isinstance(m, stages.Relay) else None for m in model.model.layers]

    assert wiring(cut(0)) == [None, (2, 4), (None, None)]
    assert wiring(cut(3)) == [(None, 1), None, (5, 5)]
    last = cut(5)
    assert wiring(last) == [(None, None), (None, 3), None]
    assert last.model.norm.pipeline_end.peers == [1, 3]
    assert not hasattr(cut(2).model.norm, "pipeline_end")
    with pytest.raises(ValueError, match=r"^--pipeline-parallel-size 2: model type 'gpt2' has no stage plan here"):
        stages.cut(tiny("gpt2"), 0, 2, 1, 0, lambda: None)


@pytest.mark.parametrize("model_type", ["qwen2_moe", "qwen3_moe", "mixtral"])
def test_the_shares_of_a_moe_block_add_up_to_the_whole(model_type):
    """Every expert (and Qwen2-MoE's gated shared expert) cut as a dense MLP, the router whole: the
    block's partial outputs, summed as the all-reduce sums them, are the uncut block's."""
    whole = tiny(model_type)
    parts = [tiny(model_type) for _ in range(2)]
    for rank, part in enumerate(parts):
        shard.shard(part, rank, 2, lambda tensor: None)
    experts = parts[0].model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape[1] == whole.model.layers[0].mlp.experts.gate_up_proj.shape[1] // 2
    x = torch.randn(1, 7, 64)
    with torch.no_grad():
        summed = sum(part.model.layers[0].mlp(x) for part in parts)
        expected = whole.model.layers[0].mlp(x)
    torch.testing.assert_close(summed, expected)


class ThreadReduce:
    """An all-reduce between threads, each standing for a rank: the parts summed in rank order."""

    def __init__(self, world: int) -> None:
        self.barrier = threading.Barrier(world)
        self.parts: list[torch.Tensor | None] = [None] * world

    def of(self, rank: int) -> Callable[[torch.Tensor], None]:
        def reduce(tensor: torch.Tensor) -> None:
            self.parts[rank] = tensor.clone()
            self.barrier.wait()
            total = sum(self.parts[1:], self.parts[0])
            self.barrier.wait()  # every rank has read every part before any writes its next one
            tensor.copy_(total)

        return reduce


PLANNED_FAMILIES = [name for name, (kind, extra) in SERVED.items() if shard.planned(family_config(kind, extra))]


def test_families_whose_transformers_plan_is_llamas_cut_are_planned_too():
    assert {"gemma", "gemma2", "gemma3_text", "granite", "olmo", "cohere", "smollm3"} <= set(PLANNED_FAMILIES)
    assert not {"olmo2", "phi3", "gpt2", "nemotron"} & set(PLANNED_FAMILIES)  # whole-width q/k norms, fused qkv, ...


@pytest.mark.parametrize("name", PLANNED_FAMILIES)
def test_two_shares_give_the_whole_models_logits(name):
    """Every planned family, cut in two and run by two threads whose row-parallel outputs are summed:
    the whole model's logits (to float rounding), with q/k norms, softcaps, windows and experts."""
    kind, extra = SERVED[name]

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(family_config(kind, extra)).eval()

    whole, parts, fabric = build(), [build(), build()], ThreadReduce(2)
    for rank, part in enumerate(parts):
        shard.shard(part, rank, 2, fabric.of(rank))
    ids = torch.randint(3, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode(), ThreadPoolExecutor(2) as pool:
        logits = list(pool.map(lambda model: model(ids).logits, parts))
        expected = whole(ids).logits
    for got in logits:
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
