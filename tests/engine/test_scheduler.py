"""The scheduler on its own (pure Python, no model): chunk geometries follow the waiting prompts,
decode plans reserve pages for every step they run, preemption takes the newest sequence and
reports the slot it left, prefix hits skip computed pages, and the waiting queue is bounded."""

import pytest

from glm5_jax.engine.paged_cache import PageAllocator
from glm5_jax.engine.scheduler import (
    DecodePlan,
    MixedPlan,
    Scheduler,
    Sequence,
    chunk_geometries,
    decode_buckets,
)
from glm5_jax.engine.types import QueueFullError

PAGE = 4


def make(num_pages=32, max_slots=4, budget=64, steps=4, **kwargs):
    return Scheduler(PageAllocator(num_pages), max_slots=max_slots, max_context=64, page_size=PAGE,
                     token_budget=budget, decode_steps=steps, **kwargs)


def sequence(name, length, max_new=8, first=0):
    return Sequence(name, list(range(first, first + length)), length, max_new)


def finish_prefill(scheduler, plan):
    for seq, count in plan.chunks:
        scheduler.computed(seq, count)
        if seq.pending == 0:
            seq.tokens.append(7)
            seq.generated += 1


def test_shapes():
    assert chunk_geometries(256) == [(4, 16), (1, 64), (16, 16), (4, 64), (1, 256)]
    assert chunk_geometries(64) == [(1, 16), (4, 16), (1, 64)] and chunk_geometries(16) == [(1, 16)]
    assert decode_buckets(32) == [1, 4, 16, 32] and decode_buckets(3) == [1, 3] and decode_buckets(1) == [1]
    # The padded tokens follow the prompts: one short prompt gets a quarter-budget step, sixteen
    # a full one.
    for prompts, geometry in ((1, (1, 64)), (3, (4, 16)), (16, (16, 16))):
        scheduler = make(num_pages=200, max_slots=16, budget=256)
        for i in range(prompts):
            scheduler.add(sequence(f"p{i}", 30 if prompts == 1 else 16, first=100 * i))
        scheduler.admit()
        assert scheduler.plan().geometry == geometry


def test_prefill_geometry_then_multi_step_decode():
    scheduler = make()
    short = [sequence(f"s{i}", 10, first=100 * i) for i in range(3)]
    for seq in short:
        scheduler.add(seq)
    assert scheduler.admit() == short
    plan = scheduler.plan()
    # Three 10-token prompts: many short rows cover them all in one step.
    assert isinstance(plan, MixedPlan) and plan.geometry == (4, 16)
    assert [count for _, count in plan.chunks] == [10, 10, 10] and not plan.decodes
    finish_prefill(scheduler, plan)
    plan = scheduler.plan()
    assert isinstance(plan, DecodePlan) and plan.steps == 4 and plan.sequences == short
    # Pages cover every position the 4 steps write: 11 tokens + 3 more -> positions < 14.
    assert all(len(seq.pages) * PAGE >= seq.computed + 4 for seq in short)
    # A long prompt arriving now gets the long-row geometry next to the decodes.
    long = sequence("long", 50, first=900)
    scheduler.add(long)
    scheduler.admit()
    plan = scheduler.plan()
    assert plan.geometry == (1, 64) and plan.chunks == [(long, 50)] and plan.decodes == short


def test_preemption_takes_the_newest_and_reports_its_slot():
    scheduler = make(num_pages=8, budget=32, steps=1)
    first, second = sequence("a", 16, max_new=20), sequence("b", 16, max_new=20, first=50)
    for seq in (first, second):
        scheduler.add(seq)
    scheduler.admit()
    plan = scheduler.plan()
    finish_prefill(scheduler, plan)
    assert [len(s.pages) for s in (first, second)] == [4, 4]  # the pool is full
    plan = scheduler.plan()  # both decode at position 16: each needs a 5th page
    assert plan.preempted == [(second, 1)] and plan.sequences == [first]
    assert second.slot is None and second.pages == [] and second.computed == 0 and second.preempted
    assert scheduler.waiting[0] is second and scheduler.preemptions == 1


def test_prefix_hits_skip_computed_pages():
    scheduler = make()
    donor = sequence("donor", 13)
    scheduler.add(donor)
    scheduler.admit()
    finish_prefill(scheduler, scheduler.plan())
    scheduler.release(donor)  # its 3 full pages stay cached
    again = sequence("again", 13)
    scheduler.add(again)
    scheduler.admit()
    assert again.cached_tokens == 12 and again.computed == 12
    plan = scheduler.plan()
    assert isinstance(plan, DecodePlan) and plan.sequences == [again]  # only the last prompt token runs
    assert scheduler.prefix_lookups[-1] == (13, 12)


def test_the_waiting_queue_is_bounded():
    scheduler = make(max_waiting=2)
    scheduler.add(sequence("a", 3))
    scheduler.add(sequence("b", 3))
    with pytest.raises(QueueFullError, match="2 requests") as error:
        scheduler.add(sequence("c", 3))
    assert error.value.retry_after > 0


def test_a_continuation_reserves_pages_ahead_and_defers_to_the_host():
    """While a decode call runs, the next one is planned for the same sequences with pages for
    both calls' positions; anything that needs the host's view first gives None, never a preemption."""
    def decoding(num_pages):
        scheduler = make(num_pages=num_pages, steps=4)
        pair = [sequence(f"s{i}", 6, max_new=10, first=100 * i) for i in range(2)]
        for seq in pair:
            scheduler.add(seq)
        scheduler.admit()
        finish_prefill(scheduler, scheduler.plan())
        return scheduler, pair, scheduler.plan()

    scheduler, pair, running = decoding(num_pages=12)
    following = scheduler.continue_decode(running)
    assert following.sequences == pair and following.steps == 4 and not following.preempted
    # 6 computed + 4 in the running call + 4 in the next -> positions < 14 covered.
    assert all(len(seq.pages) * PAGE >= 14 for seq in pair)
    late = sequence("late", 5, first=900)
    scheduler.add(late)
    assert scheduler.continue_decode(running) is None  # admission first
    scheduler.release(late)
    for seq in pair:
        seq.generated = seq.max_new - 4  # the running call reaches every length: nothing to continue
    assert scheduler.continue_decode(running) is None

    scheduler, pair, running = decoding(num_pages=7)  # 6 pages in use, the next call needs 2 more
    assert scheduler.continue_decode(running) is None
    assert scheduler.preemptions == 0 and scheduler.running == pair


def test_speculative_calls_reserve_every_position_a_round_may_write():
    """With N-token speculation a decode step writes up to N + 1 positions (the pending token and
    N drafts): plans and continuations reserve that much, never past a sequence's allowed length."""
    scheduler = make(num_pages=64, steps=2, positions_per_step=3)
    long, short = sequence("long", 6, max_new=40), sequence("short", 6, max_new=5, first=100)
    for seq in (long, short):
        scheduler.add(seq)
    scheduler.admit()
    finish_prefill(scheduler, scheduler.plan())
    running = scheduler.plan()
    assert isinstance(running, DecodePlan) and running.steps == 2
    assert len(long.pages) * PAGE >= 6 + 2 * 3 and len(short.pages) * PAGE >= 6 + 4
    assert len(short.pages) == -(-(6 + 4) // PAGE)  # 4 tokens still allowed: no more than that
    following = scheduler.continue_decode(running)
    assert following.sequences == [long, short]
    assert len(long.pages) * PAGE >= 6 + (2 + 2) * 3 and len(short.pages) == -(-(6 + 4) // PAGE)
