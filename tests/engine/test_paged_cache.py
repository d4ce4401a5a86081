"""Page bookkeeping: allocation and ref counts, the hash chain, LRU eviction of cached pages and
host offload / reload (pure Python, no model)."""

import numpy as np
import pytest

from glm5_jax.engine.paged_cache import PageAllocator, page_hashes


class FakeDevice:
    """Page contents as Python values, standing in for the device cache."""

    def __init__(self, num_pages):
        self.data = [None] * num_pages

    def offload(self, page):
        return self.data[page]

    def reload(self, page, data):
        self.data[page] = data


def test_hash_chain_names_the_prefix():
    a = page_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert len(a) == 2  # the partial third page is not hashed
    b = page_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    assert a == b
    # Same second page after a different first page: a different key.
    c = page_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert c[0] != a[0] and c[1] != a[1]
    assert page_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, count=1) == a[:1]
    # Continuing a chain from its last key equals hashing the whole sequence.
    assert page_hashes([5, 6, 7, 8], 4, parent=a[0]) == a[1:]


def test_allocate_release_and_ref_counts():
    pages = PageAllocator(3)
    taken = [pages.allocate() for _ in range(3)]
    assert sorted(taken) == [0, 1, 2] and pages.allocate() is None
    assert pages.used == 3 and pages.available == 0
    pages.release(taken[1])
    assert pages.available == 1 and pages.allocate() == taken[1]
    for page in taken:
        pages.release(page)
    assert pages.used == 0 and int(pages.refs.min()) == 0
    with pytest.raises(ValueError, match="released more often"):
        pages.release(0)
    with pytest.raises(ValueError, match="offload and reload"):
        PageAllocator(3, host_pages=2)


def test_cached_pages_are_hit_and_evicted_least_recent_first():
    pages = PageAllocator(4)
    keys = page_hashes(list(range(12)), 4)  # three pages of one prefix
    owned = [pages.allocate() for _ in keys]
    for page, key in zip(owned, keys, strict=True):
        pages.register(page, key)
    for page in reversed(owned):  # the engine releases a sequence's tail first
        pages.release(page)
    assert pages.cached == 3 and pages.used == 0
    assert pages.cached_hashes() == [keys[2], keys[1], keys[0]]
    hit, host_hits = pages.match(keys[:2])
    assert hit == owned[:2] and host_hits == 0 and list(pages.refs[owned[:2]]) == [1, 1]
    # A second reader shares the pages: ref count 2.
    assert pages.match(keys[:1])[0] == owned[:1] and pages.refs[owned[0]] == 2
    # Only the free page and the unreferenced tail page can be handed out; the tail is evicted.
    first, second = pages.allocate(), pages.allocate()
    assert {first, second} == {owned[2], next(p for p in range(4) if p not in owned)}
    assert pages.match(keys)[0] == owned[:2]  # stops at the evicted third page
    assert pages.allocate() is None


def test_offload_to_host_and_reload():
    device = FakeDevice(2)
    pages = PageAllocator(2, host_pages=1, offload=device.offload, reload=device.reload)
    keys = page_hashes(list(range(8)), 4)
    page = pages.allocate()
    device.data[page] = "latents of page 0"
    pages.register(page, keys[0])
    pages.release(page)
    taken = [pages.allocate(), pages.allocate()]  # the free page, then the cached one is evicted
    assert pages.on_host(keys[0]) and pages.evictions == 1 and pages.host_used == 1
    for p in taken:
        device.data[p] = "overwritten"
        pages.release(p)
    hit, host_hits = pages.match(keys)
    assert host_hits == 1 and len(hit) == 1 and device.data[hit[0]] == "latents of page 0"
    assert not pages.on_host(keys[0]) and pages.reloads == 1
    # Host memory is an LRU of host_pages entries: a second offload pushes out the oldest.
    pages.release(hit[0])
    other = page_hashes(list(range(100, 104)), 4)[0]
    extra = pages.allocate()
    pages.register(extra, other)
    pages.release(extra)
    pages.allocate(), pages.allocate()
    assert pages.host_used == 1 and pages.evictions == 3


def test_no_leak_over_many_random_sequences():
    rng = np.random.default_rng(0)
    device = FakeDevice(16)
    pages = PageAllocator(16, host_pages=4, offload=device.offload, reload=device.reload)
    prefixes = [rng.integers(0, 5, 12).tolist() for _ in range(3)]
    for _ in range(200):
        tokens = prefixes[rng.integers(3)] + rng.integers(0, 5, rng.integers(0, 9)).tolist()
        keys = page_hashes(tokens, 4)
        held, _ = pages.match(keys)
        while len(held) < len(keys) and (page := pages.allocate()) is not None:
            pages.register(page, keys[len(held)])
            held.append(page)
        assert int(pages.refs.min()) >= 0
        for page in reversed(held):
            pages.release(page)
    assert pages.used == 0 and pages.available == 16 and int(pages.refs.max()) == 0
    assert pages.host_used <= 4
