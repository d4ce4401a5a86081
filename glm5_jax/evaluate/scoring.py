"""Scores and their confidence intervals: pass@k, Wilson and bootstrap intervals, percentiles,
final-number extraction (GSM8K style) and answer normalisation.

Every reported number is a `Metric`: the value, a 95% interval and the method that gave it, so a
report can say whether two runs differ by more than their noise.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Sequence

import numpy as np

Z_95 = 1.959963984540054  # two-sided 95% normal quantile
BOOTSTRAP_RESAMPLES = 1000


@dataclasses.dataclass(frozen=True)
class Metric:
    """One score. ci_low / ci_high: the 95% interval (None when undefined, e.g. one item);
    method: how the interval was computed ("wilson", "bootstrap", "none"); count: the items it
    is computed over; higher_is_better: False for losses, bits per byte and latencies."""

    value: float
    ci_low: float | None
    ci_high: float | None
    method: str
    count: int
    higher_is_better: bool = True
    unit: str = ""

    def to_dict(self) -> dict:
        """As JSON-able values (a NaN value, from no items, becomes None)."""
        values = dataclasses.asdict(self)
        if isinstance(self.value, float) and math.isnan(self.value):
            values["value"] = None
        return values

    @classmethod
    def from_dict(cls, values: dict) -> Metric:
        return cls(**values)


# ---------------------------------------------------------------- pass@k
def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate from n samples of which c passed: 1 - C(n-c, k) / C(n, k)
    (Chen et al. 2021), computed as 1 - prod_{i=n-c+1}^{n} (1 - k / i), which stays exact in
    floating point where the binomials overflow."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


# ---------------------------------------------------------------- intervals
def wilson_interval(successes: int, total: int, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval of a proportion (well behaved at 0 and 1, unlike the normal one)."""
    if total <= 0:
        raise ValueError("the Wilson interval needs at least one trial")
    p = successes / total
    denominator = 1 + z * z / total
    center = (p + z * z / (2 * total)) / denominator
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / denominator
    low = 0.0 if successes == 0 else max(0.0, center - half)  # exact ends, not rounding residue
    high = 1.0 if successes == total else min(1.0, center + half)
    return low, high


def proportion(outcomes: Sequence[bool | int | float], unit: str = "") -> Metric:
    """The share of successes among 0/1 outcomes, with its Wilson interval."""
    total = len(outcomes)
    if total == 0:
        return Metric(math.nan, None, None, "none", 0, unit=unit)
    successes = int(round(float(np.sum(outcomes))))
    low, high = wilson_interval(successes, total)
    return Metric(successes / total, low, high, "wilson", total, unit=unit)


def bootstrap(
    values: Sequence[float] | np.ndarray,
    statistic: Callable[[np.ndarray], np.ndarray] | None = None,
    *,
    weights: Sequence[float] | None = None,
    higher_is_better: bool = True,
    unit: str = "",
    seed: int = 0,
    resamples: int = BOOTSTRAP_RESAMPLES,
) -> Metric:
    """A statistic of per-item values with a percentile-bootstrap 95% interval (items resampled
    with replacement, a fixed seed: the same data give the same interval).

    statistic: maps a [R, N] array of resampled values to [R] (default: the mean). weights: per-item
    weights for a ratio of sums (sum(values) / sum(weights), e.g. bits over bytes), resampled with
    their items.
    """
    data = np.asarray(values, np.float64)
    count = data.shape[0]
    if count == 0:
        return Metric(math.nan, None, None, "none", 0, higher_is_better, unit)
    if weights is not None:
        weight = np.asarray(weights, np.float64)
        point = float(data.sum() / weight.sum())
    else:
        statistic = statistic or (lambda x: x.mean(axis=-1))
        point = float(statistic(data[None])[0])
    if count == 1:
        return Metric(point, None, None, "none", 1, higher_is_better, unit)
    index = np.random.default_rng(seed).integers(0, count, size=(resamples, count))  # [R, N]
    if weights is not None:
        estimates = data[index].sum(axis=1) / weight[index].sum(axis=1)
    else:
        estimates = statistic(data[index])
    low, high = np.percentile(estimates, [2.5, 97.5])
    return Metric(point, float(low), float(high), "bootstrap", count, higher_is_better, unit)


def percentile(
    values: Sequence[float], q: float, unit: str = "s", higher_is_better: bool = False, seed: int = 0
) -> Metric:
    """The q-th percentile (0-100, linear interpolation) with a bootstrap interval."""
    return bootstrap(
        values,
        lambda x: np.percentile(x, q, axis=-1),
        higher_is_better=higher_is_better,
        unit=unit,
        seed=seed,
    )


# ---------------------------------------------------------------- answers
_STRICT_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"-?[$0-9.,]*[0-9]+")


def normalize_number(text: str) -> str | None:
    """'1,234.50' -> '1234.5', '$7' -> '7', '42.' -> '42'; None when it is not a number."""
    cleaned = text.strip().replace(",", "").replace("$", "").rstrip(".")
    try:
        value = float(cleaned)
    except ValueError:
        return None
    if not math.isfinite(value):
        return None
    return str(int(value)) if value == int(value) else repr(value)


def reference_number(answer: str) -> str | None:
    """The final number of a GSM8K reference solution (after `####`), or of a bare answer."""
    if "####" in answer:
        answer = answer.split("####")[-1]
    return normalize_number(answer)


def extract_strict(output: str) -> str | None:
    """GSM8K's strict match: the number after the first `#### ` in the output."""
    found = _STRICT_ANSWER.search(output)
    return normalize_number(found.group(1)) if found else None


def extract_last_number(output: str) -> str | None:
    """GSM8K's flexible extract: the last number written in the output."""
    for candidate in reversed(_NUMBER.findall(output)):
        number = normalize_number(candidate)
        if number is not None:
            return number
    return None


def normalize_text(text: str) -> str:
    """Lower case, punctuation dropped, whitespace collapsed (SQuAD-style answer comparison)."""
    text = re.sub(r"[^\w\s]", " ", text.lower())
    return " ".join(text.split())


def token_f1(prediction: str, reference: str) -> float:
    """Word-overlap F1 of two answers after normalize_text (SQuAD's metric)."""
    predicted, expected = normalize_text(prediction).split(), normalize_text(reference).split()
    if not predicted or not expected:
        return float(predicted == expected)
    common = sum(min(predicted.count(w), expected.count(w)) for w in set(predicted))
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(expected)
    return 2 * precision * recall / (precision + recall)
