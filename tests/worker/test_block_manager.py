from tests.worker.factories import make_request
from worker.block_manager import BlockManager, blocks_for


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


def computed(blocks: BlockManager, request, num_tokens: int) -> None:
    """Pretend a step computed ``num_tokens`` tokens of ``request``."""
    assert blocks.allocate(request, num_tokens)
    request.num_computed_tokens += num_tokens
    blocks.register_full_blocks(request)


def test_a_shared_prefix_is_reused_block_by_block():
    blocks = BlockManager(num_blocks=8, block_size=4)
    prefix = list(range(100, 110))  # 2 full blocks + 2 tokens
    first = make_request("a", 0, token_ids=prefix + [1, 2])
    computed(blocks, first, 12)
    second = make_request("b", 0, token_ids=prefix + [7, 8, 9])
    assert blocks.match_prefix(second) == 8
    assert second.block_ids == first.block_ids[:2] and second.num_computed_tokens == 8
    assert [blocks.blocks[i].ref_count for i in second.block_ids] == [2, 2]
    assert blocks.hit_tokens == 8


def test_at_least_one_token_is_left_to_compute():
    blocks = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(100, 108))  # exactly two blocks
    computed(blocks, make_request("a", 0, token_ids=tokens), 8)
    again = make_request("b", 0, token_ids=tokens)
    assert blocks.match_prefix(again) == 4  # the second block holds the last token: recompute it


def test_same_block_after_a_different_prefix_is_not_a_hit():
    blocks = BlockManager(num_blocks=8, block_size=4)
    computed(blocks, make_request("a", 0, token_ids=[1, 2, 3, 4, 5, 6, 7, 8, 9]), 9)
    other = make_request("b", 0, token_ids=[9, 9, 9, 9, 5, 6, 7, 8, 9])
    assert blocks.match_prefix(other) == 0


def test_freed_blocks_stay_cached_until_reused_least_recent_first():
    blocks = BlockManager(num_blocks=4, block_size=4)
    first = make_request("a", 0, token_ids=list(range(100, 109)))
    computed(blocks, first, 9)  # blocks: 2 full (cached) + 1 partial
    cached_ids = first.block_ids[:2]
    blocks.free(first)
    assert blocks.num_free_blocks == 4
    again = make_request("b", 0, token_ids=list(range(100, 109)))
    assert blocks.match_prefix(again) == 8  # still there after its owner finished
    blocks.free(again)
    # Other tokens need 3 blocks: the never-used block and the partial one go first, then the
    # tail of the prefix (freed before its head), and the prefix's first block survives.
    other = make_request("c", 0, token_ids=list(range(500, 512)))
    assert blocks.allocate(other, 12)
    assert cached_ids[0] not in other.block_ids and cached_ids[1] in other.block_ids
    assert blocks.match_prefix(make_request("d", 0, token_ids=list(range(100, 109)))) == 4


def test_free_returns_shared_blocks_only_when_the_last_user_leaves():
    blocks = BlockManager(num_blocks=4, block_size=4)
    tokens = list(range(100, 106))
    a = make_request("a", 0, token_ids=tokens)
    computed(blocks, a, 6)
    b = make_request("b", 0, token_ids=tokens)
    blocks.match_prefix(b)
    assert blocks.allocate(b, 2)
    blocks.free(a)
    assert blocks.num_free_blocks == 4 - 2  # the shared block and b's own block are still in use
    blocks.free(b)
    assert blocks.num_free_blocks == 4


def test_an_api_keys_salt_keeps_its_blocks_its_own():
    blocks = BlockManager(num_blocks=8, block_size=4)
    prefix = list(range(100, 110))
    first = make_request("a", 0, token_ids=prefix + [1])
    first.tenant = "key-a"
    computed(blocks, first, 11)
    for tenant, hit in (("key-b", 0), (None, 0), ("key-a", 8)):
        other = make_request(f"b-{tenant}", 0, token_ids=prefix + [2])
        other.tenant = tenant
        assert blocks.match_prefix(other) == hit, tenant
        blocks.free(other)


def test_retained_blocks_are_evicted_after_every_other():
    blocks = BlockManager(num_blocks=6, block_size=4)
    kept = make_request("kept", 0, token_ids=list(range(100, 109)))
    kept.retain_s = 3600.0
    computed(blocks, kept, 9)
    blocks.free(kept)
    older = make_request("older", 0, token_ids=list(range(200, 209)))
    computed(blocks, older, 9)
    blocks.free(older)
    squeeze = make_request("new", 0, token_ids=list(range(300, 313)))
    computed(blocks, squeeze, 13)  # 4 blocks: every free unretained one, none of the retained
    blocks.free(squeeze)
    assert blocks.match_prefix(make_request("again", 0, token_ids=list(range(100, 109)))) == 8
    assert blocks.match_prefix(make_request("older-again", 0, token_ids=list(range(200, 209)))) == 0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def cache_prompt(blocks: BlockManager, first: int, tokens: int = 9, retain_s: float = 0.0) -> None:
    """Compute and free a prompt of ``tokens`` tokens that asked for ``retain_s`` of retention."""
    request = make_request(f"r-{first}", 0, token_ids=list(range(first, first + tokens)))
    request.retain_s = retain_s
    computed(blocks, request, tokens)
    blocks.free(request)


def hits(blocks: BlockManager, first: int) -> int:
    probe = make_request(f"probe-{first}", 0, token_ids=list(range(first, first + 9)))
    found = blocks.match_prefix(probe)
    blocks.free(probe)
    return found


def test_a_retention_ends_after_its_ttl_and_the_shorter_one_goes_first():
    clock = Clock()
    blocks = BlockManager(num_blocks=9, block_size=4, clock=clock)
    cache_prompt(blocks, 100, retain_s=3600.0)  # cache_control ttl 1h: 2 full blocks and a tail
    cache_prompt(blocks, 200, retain_s=300.0)  # ttl 5m
    cache_prompt(blocks, 300)
    assert blocks.num_retained_blocks == 4
    cache_prompt(blocks, 400, tokens=25)  # 7 blocks: the 5 unretained, then the 2 whose retention ends first
    assert (hits(blocks, 100), hits(blocks, 200), hits(blocks, 300)) == (8, 0, 0)

    clock.now += 3000.0  # a hit by a retaining request renews the hour: now until 4000 + 3600
    renew = make_request("renew", 0, token_ids=list(range(100, 109)))
    renew.retain_s = 3600.0
    blocks.match_prefix(renew)
    blocks.free(renew)
    clock.now += 3599.0
    assert blocks.num_retained_blocks == 2
    cache_prompt(blocks, 600, tokens=25)  # 7 blocks: all unretained ones
    assert hits(blocks, 100) == 8
    clock.now += 2.0  # the hour is over: its blocks are the next to go
    assert blocks.num_retained_blocks == 0
    cache_prompt(blocks, 700, tokens=25)  # takes them, then the LRU's 5 oldest: 600's tail first
    assert hits(blocks, 100) == 0 and hits(blocks, 600) == 8
    assert blocks.num_free_blocks == blocks.num_blocks


def test_a_retained_block_used_again_and_again_keeps_the_retention_heap_small():
    clock = Clock()
    blocks = BlockManager(num_blocks=9, block_size=4, clock=clock)
    cache_prompt(blocks, 100, retain_s=3600.0)
    for _ in range(500):  # each hit renews it, and its free pushes a new entry
        clock.now += 1.0
        cache_prompt(blocks, 100, retain_s=3600.0)
    assert len(blocks._kept_order) <= 2 * len(blocks._kept) + 65
    cache_prompt(blocks, 400, tokens=25)  # 7 blocks: every unretained one, none of the retained
    assert hits(blocks, 100) == 8
