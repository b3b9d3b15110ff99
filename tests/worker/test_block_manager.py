from worker.block_manager import BlockManager, blocks_for
from tests.worker.factories import make_request


def test_blocks_for_rounds_up():
    assert [blocks_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_allocate_grows_a_request_block_by_block():
    blocks = BlockManager(num_blocks=4, block_size=4)
    request = make_request("a", 6)
    assert blocks.allocate(request, 6)
    assert len(request.block_ids) == 2 and blocks.num_free_blocks == 2
    request.num_computed_tokens = 6
    assert blocks.allocate(request, 2)  # 8 tokens still fit in 2 blocks
    assert len(request.block_ids) == 2
    request.num_computed_tokens = 8
    assert blocks.allocate(request, 1)
    assert len(request.block_ids) == 3 and blocks.num_free_blocks == 1


def test_allocate_fails_without_changing_anything():
    blocks = BlockManager(num_blocks=2, block_size=4)
    request = make_request("a", 12)
    assert not blocks.allocate(request, 12)
    assert request.block_ids == [] and blocks.num_free_blocks == 2


def test_free_returns_every_block():
    blocks = BlockManager(num_blocks=4, block_size=4)
    a, b = make_request("a", 8), make_request("b", 4)
    assert blocks.allocate(a, 8) and blocks.allocate(b, 4)
    blocks.free(a)
    blocks.free(b)
    assert a.block_ids == [] and blocks.num_free_blocks == 4
    assert len(set(blocks._free)) == 4
