"""Prefix caching for hybrid models (GLM-5.3-Flash), the bookkeeping of KDA state snapshots at
cached page boundaries (pure Python): snapshots live and die with their cached pages (device or
host), a prefix hit ends at a page with a snapshot, prefill chunks are cut at page boundaries;
and the device copies between state slots and snapshots, every layer's entry, out-of-range
targets writing nothing. The engine serving prefix hits (== forward, with preemption) is tested
in tests/engine/test_hybrid_serving.py, on its one compiled engine."""

import jax.numpy as jnp
import numpy as np

from glm5_jax.engine.paged_cache import PageAllocator, StateSnapshots, page_hashes
from glm5_jax.engine.scheduler import Scheduler, Sequence
from glm5_jax.model.attention.linear_pages import restore_state, save_state


def test_snapshots_are_forgotten_with_their_pages():
    snapshots = StateSnapshots(2)
    pages = PageAllocator(3, snapshots=snapshots)
    keys = page_hashes(list(range(12)), 4)
    for key in keys:
        page = pages.allocate()
        pages.register(page, key)
        pages.release(page)  # cached
    slots = [snapshots.take(key) for key in keys[:2]]
    assert sorted(slots) == [0, 1] and snapshots.used == 2
    assert snapshots.take(keys[2]) == slots[0] and keys[0] not in snapshots  # LRU gives its slot up
    pages.allocate()  # evicts the oldest cached page (keys[0], no snapshot any more)
    pages.allocate()  # evicts keys[1]: its snapshot goes with it
    assert keys[1] not in snapshots and snapshots.used == 1 and snapshots.take(keys[0]) == slots[1]


def test_snapshots_survive_host_offload_until_the_host_drops_the_page():
    snapshots = StateSnapshots(4)
    pages = PageAllocator(1, host_pages=1, snapshots=snapshots, offload=lambda page: page,
                          reload=lambda page, data: None)
    keys = page_hashes(list(range(8)), 4)
    for key in keys:
        page = pages.allocate()  # the second evicts the first page to the host
        pages.register(page, key)
        snapshots.take(key)
        pages.release(page)
    assert keys[0] in snapshots and pages.on_host(keys[0])
    pages.allocate()  # keys[1] to the host, which drops keys[0]
    assert keys[0] not in snapshots and keys[1] in snapshots


def test_hits_end_at_a_snapshot_and_chunks_at_page_boundaries():
    pages = PageAllocator(16, snapshots=StateSnapshots(4))
    scheduler = Scheduler(pages, max_slots=2, max_context=64, page_size=4, token_budget=16)
    tokens = list(range(2, 30))  # 28 tokens: 7 pages
    first = Sequence("a", list(tokens), len(tokens), 4)
    scheduler.add(first)
    scheduler.admit()
    # 16-token chunk, then 12 tokens crossing no boundary but their last: 16..28.
    plan = scheduler.plan()
    assert plan.chunks == [(first, 16)]
    scheduler.computed(first, 16)
    assert scheduler.snapshot_wanted(first) == first.hashes[3]
    pages.snapshots.take(first.hashes[3])
    # A chunk from 18 that would end at 26 (8-token rows) is cut at 24; one ending at 28 is not cut.
    first.computed = 18
    assert scheduler._chunk_length(first, 8) == 6 and scheduler._chunk_length(first, 16) == 10
    first.computed = 16
    scheduler.release(first)
    # Pages 1..6 are cached; only page 4 has a snapshot: the hit is 4 pages, not 6.
    second = Sequence("b", tokens[:24] + [40, 41], 26, 4)
    scheduler.add(second)
    scheduler.admit()
    assert second.computed == 16 and len(second.pages) == 4


def test_state_copies_between_slots_and_snapshots():
    # 2 layers x 3 slots, 2 layers x 2 snapshots; entry = layer * count + index.
    def pools(rows, start=0.0):
        values = jnp.arange(start, start + rows, dtype=jnp.float32)
        return {"stack": {"conv": values.reshape(rows, 1, 1), "recurrent": values.reshape(rows, 1, 1, 1)}}

    def conv(tree):
        return np.asarray(tree["stack"]["conv"]).ravel().tolist()

    snapshots = save_state(pools(6), pools(4, 10.0), jnp.int32(1), jnp.int32(1), slots=3, snapshots=2)
    assert conv(snapshots) == [10, 1, 12, 4]  # slot 1 of both layers into snapshot 1
    snapshots = save_state(pools(6), snapshots, jnp.int32(2), jnp.int32(2), slots=3, snapshots=2)
    assert conv(snapshots) == [10, 1, 12, 4]  # snapshot 2 of 2: nothing written (warm-up)
    assert conv(restore_state(pools(6), snapshots, jnp.int32(3), jnp.int32(1), slots=3, snapshots=2)) == \
        [0, 1, 2, 3, 4, 5]  # slot 3 of 3: nothing written
    restored = restore_state(pools(6), snapshots, jnp.int32(0), jnp.int32(0), slots=3, snapshots=2)
    assert conv(restored) == [10, 1, 2, 12, 4, 5]
    assert np.asarray(restored["stack"]["recurrent"]).ravel().tolist() == [10, 1, 2, 12, 4, 5]
