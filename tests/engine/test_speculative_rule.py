"""Tests for speculative decoding's accept/reject rule: emitted tokens follow the target, greedy rows
take the matching prefix, `verifiable` caps acceptance, and each row depends only on its own key."""

import numpy as np
import pytest

from glm5_jax.engine.rejection_sampling import accept_drafts

# Every call uses this one shape, so accept_drafts compiles once for the module.
R, N, V = 40_000, 2, 5
# chi2.ppf(1 - 1e-4, df) for df = 1..4: a correct rule fails a check with probability 1e-4.
CHI2_CRITICAL = {1: 15.137, 2: 18.421, 3: 21.108, 4: 23.513}

# Target p_0, p_1, p_2 and draft q_0, q_1: q puts mass where p has little or none (token 4 under p_0,
# token 3 under p_1), so about half the first drafts and 60% of the second are rejected.
P = np.array([
    [0.40, 0.30, 0.20, 0.10, 0.00],
    [0.05, 0.15, 0.50, 0.00, 0.30],
    [0.10, 0.40, 0.05, 0.25, 0.20],
])
Q = np.array([
    [0.10, 0.10, 0.20, 0.20, 0.40],
    [0.30, 0.30, 0.10, 0.20, 0.10],
])


def chi2_stat(samples: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic of `samples` against `probs` and its degrees of freedom; inf when a sample
    falls where probs is 0."""
    counts = np.bincount(samples, minlength=len(probs))
    support = probs > 0
    if counts[~support].any():
        return float("inf"), int(support.sum()) - 1
    expected = probs[support] * len(samples)
    return float(np.sum((counts[support] - expected) ** 2 / expected)), int(support.sum()) - 1


def assert_distributed_as(samples: np.ndarray, probs: np.ndarray) -> None:
    assert len(samples) >= 1000, len(samples)
    stat, df = chi2_stat(samples, probs)
    assert stat < CHI2_CRITICAL[df], (stat, df, np.bincount(samples, minlength=len(probs)) / len(samples))


def draw(rng: np.random.Generator, probs: np.ndarray, size: int) -> np.ndarray:
    return rng.choice(len(probs), size=size, p=probs).astype(np.int32)


def make_batch(rng, p=P, q=Q, verifiable=N, greedy=False):
    """R rows with target p and draft q at every row, drafts drawn from q, distinct keys."""
    drafts = np.stack([draw(rng, q[i], R) for i in range(N)], axis=1)
    return dict(
        target_probs=np.broadcast_to(p, (R, N + 1, V)).astype(np.float32),
        target_greedy=np.broadcast_to(p.argmax(-1), (R, N + 1)).astype(np.int32),
        draft_tokens=drafts,
        draft_probs=np.broadcast_to(q, (R, N, V)).astype(np.float32),
        greedy=np.broadcast_to(np.asarray(greedy), (R,)).copy(),
        verifiable=np.broadcast_to(np.asarray(verifiable, np.int32), (R,)).copy(),
        keys=rng.integers(0, 2**32, size=(R, 2), dtype=np.uint32),
    )


def run(batch) -> tuple[np.ndarray, np.ndarray]:
    accepted, next_token = accept_drafts(**batch)
    return np.asarray(accepted), np.asarray(next_token)


def emitted(batch, accepted, next_token, position: int) -> np.ndarray:
    """[R] the token each row emits at `position` (valid where accepted >= position)."""
    if position == N:
        return next_token
    return np.where(accepted > position, batch["draft_tokens"][:, position], next_token)


@pytest.fixture(scope="module")
def sampled():
    batch = make_batch(np.random.default_rng(0))
    return batch, *run(batch)


def test_emitted_tokens_follow_the_target(sampled):
    batch, accepted, next_token = sampled
    assert accepted.min() >= 0 and accepted.max() <= N
    assert_distributed_as(emitted(batch, accepted, next_token, 0), P[0])
    after_first = accepted >= 1
    assert_distributed_as(emitted(batch, accepted, next_token, 1)[after_first], P[1])
    assert_distributed_as(next_token[accepted == N], P[2])  # the bonus token

    # Acceptance rates: sum_x min(p_i(x), q_i(x)), within 5 standard errors.
    second_rate = (accepted[after_first] == N).mean()
    for rate, i, rows in ((after_first.mean(), 0, R), (second_rate, 1, after_first.sum())):
        expected = np.minimum(P[i], Q[i]).sum()
        assert abs(rate - expected) < 5 * np.sqrt(expected * (1 - expected) / rows), (i, rate, expected)


def test_wrong_rules_fail_the_same_check(sampled):
    """The check above can fail: accepting every draft emits q_0; resampling a rejection from p_0
    instead of the residual max(p_0 - q_0, 0) emits min(p_0, q_0) + (1 - a) p_0."""
    batch, accepted, _ = sampled
    stat, df = chi2_stat(batch["draft_tokens"][:, 0], P[0])
    assert stat > CHI2_CRITICAL[df]
    rng = np.random.default_rng(1)
    no_residual = np.where(accepted >= 1, batch["draft_tokens"][:, 0], draw(rng, P[0], R))
    stat, df = chi2_stat(no_residual, P[0])
    assert np.isfinite(stat) and stat > CHI2_CRITICAL[df], stat


# (draft_tokens, target_greedy, verifiable, accepted, next_token)
GREEDY_CASES = [
    ([1, 2], [1, 2, 3], 2, 2, 3),
    ([1, 4], [1, 2, 3], 2, 1, 2),
    ([0, 2], [1, 2, 3], 2, 0, 1),  # the second draft matches but follows a mismatch
    ([1, 2], [1, 2, 3], 1, 1, 2),  # both match, only one verifiable
    ([1, 2], [1, 2, 3], 0, 0, 1),
    ([4, 4], [4, 4, 0], 2, 2, 0),
]


def test_greedy_rows_take_the_matching_prefix():
    """Greedy rows follow target_greedy only: the probabilities (all mass on token 0, drafts all
    mass on themselves) would have the sampled rule reject nearly everything."""
    rng = np.random.default_rng(2)
    batch = make_batch(rng, greedy=True)
    cases = np.arange(R) % len(GREEDY_CASES)
    drafts, target, verifiable, want_accepted, want_next = (
        np.array([c[j] for c in GREEDY_CASES], np.int32)[cases] for j in range(5))
    one_hot = np.eye(V, dtype=np.float32)
    batch.update(
        target_probs=np.broadcast_to(one_hot[0], (R, N + 1, V)).copy(),
        target_greedy=target, draft_tokens=drafts, draft_probs=one_hot[drafts], verifiable=verifiable)
    accepted, next_token = run(batch)
    np.testing.assert_array_equal(accepted, want_accepted)
    np.testing.assert_array_equal(next_token, want_next)


def test_verifiable_caps_sampled_rows():
    """Half the rows verify no draft, half only the first. The second draft is drawn from p_1 itself,
    so the rule would always accept it if it looked past `verifiable`."""
    rng = np.random.default_rng(3)
    q = np.stack([Q[0], P[1]])
    verifiable = (np.arange(R) % 2).astype(np.int32)
    batch = make_batch(rng, q=q, verifiable=verifiable)
    accepted, next_token = run(batch)
    none, one = verifiable == 0, verifiable == 1
    assert (accepted[none] == 0).all() and (accepted[one] <= 1).all()
    assert_distributed_as(next_token[none], P[0])  # nothing verified: a plain draw from p_0
    assert_distributed_as(emitted(batch, accepted, next_token, 0)[one], P[0])
    assert_distributed_as(next_token[one & (accepted == 1)], P[1])  # the bonus comes from p_1, not p_2


def test_draft_outside_its_own_support_gives_no_nan():
    """Drafts with q(d) = 0 cannot have been drawn, but must not break the rule: the target p_0 = q_0
    both put 0 on token 4. Draft 1 (q = 0, p > 0 under p_1) is accepted; draft 4 is rejected, and as
    the residual p_0 - q_0 is all zero the next token comes from p_0."""
    rng = np.random.default_rng(4)
    q = np.stack([P[0], np.array([0.0, 0.0, 0.5, 0.5, 0.0])])
    batch = make_batch(rng, q=q)
    half = np.arange(R) < R // 2
    batch["draft_tokens"][:, 0] = np.where(half, 4, batch["draft_tokens"][:, 0])
    batch["draft_tokens"][:, 1] = 1
    accepted, next_token = run(batch)
    assert (accepted[half] == 0).all()
    assert_distributed_as(next_token[half], P[0])
    assert (accepted[~half] == N).all()  # draft 0 from q_0 = p_0, draft 1 with q = 0 < p_1
    assert_distributed_as(next_token[~half], P[2])


def test_rows_depend_only_on_their_own_key(sampled):
    batch, accepted, next_token = sampled
    again = run(batch)
    np.testing.assert_array_equal(again[0], accepted)
    np.testing.assert_array_equal(again[1], next_token)

    perm = np.random.default_rng(5).permutation(R)
    permuted = run({name: value[perm] for name, value in batch.items()})
    np.testing.assert_array_equal(permuted[0], accepted[perm])
    np.testing.assert_array_equal(permuted[1], next_token[perm])

    fresh = run(dict(batch, keys=np.random.default_rng(6).integers(0, 2**32, (R, 2), dtype=np.uint32)))
    assert (fresh[0] != accepted).mean() > 0.2 and (fresh[1] != next_token).mean() > 0.2
