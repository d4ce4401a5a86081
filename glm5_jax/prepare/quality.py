"""Level 2: a learned quality score, hashed n-gram logistic regression trained by this project.

    python -m glm5_jax.prepare.quality train --config configs/data/demo.py [--output MODEL.npz]
    python -m glm5_jax.prepare.quality score --model MODEL.npz FILE...

Features: lower-cased word and punctuation tokens (the first `max_tokens`) and their bigrams,
hashed (crc32, stable across processes and machines) into `dims` buckets; log(1 + count), L2
normalised. Model: logistic regression, L2-regularised, fitted with Newton-CG (scipy). Data: curated
passages against synthetic junk made from them (glm5_jax/prepare/quality_data.py), with a
held-out split on which precision, recall and the constant baseline are reported and stored in
the model file (an .npz of a few hundred KB: weights, bias, dims, max_tokens, metrics).
The prepare pipeline drops documents of the configured domains scoring below `quality.threshold`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import os
import re
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from glm5_jax.data.sources import Document
from glm5_jax.prepare.config import QualitySettings
from glm5_jax.prepare.progress import Progress, say
from glm5_jax.prepare.quality_data import labelled_examples, positive_passages
from glm5_jax.prepare.readers import scan_sources

_TOKEN = re.compile(r"\w+|[^\w\s]")
DEFAULT_DIMS = 1 << 16
DEFAULT_MAX_TOKENS = 2000
DEFAULT_L2 = 1e-6  # held-out accuracy on the demo: 0.928 at 1e-4, 0.968 at 1e-5, 0.976 at 1e-6
DEFAULT_MAX_PASSAGES = 6000  # a fixed sample: more adds little held-out accuracy and costs time


class TrainingDataError(ValueError):
    """The classifier's labelled data cannot be built (no curated source, or too few passages)."""


@dataclasses.dataclass(frozen=True)
class QualityModel:
    """weights: float32 [dims]; score = sigmoid(features . weights + bias)."""

    weights: np.ndarray
    bias: float
    max_tokens: int = DEFAULT_MAX_TOKENS
    metrics: dict = dataclasses.field(default_factory=dict)

    @property
    def dims(self) -> int:
        return int(self.weights.shape[0])

    def score(self, text: str) -> float:
        """The probability that `text` is curated-like, in (0, 1)."""
        indices, values = hashed_features(text, self.dims, self.max_tokens)
        logit = float(values @ self.weights[indices]) + self.bias
        return float(1.0 / (1.0 + np.exp(-logit)))


def hashed_features(
    text: str, dims: int, max_tokens: int = DEFAULT_MAX_TOKENS
) -> tuple[np.ndarray, np.ndarray]:
    """Sparse features of a text: (bucket indices int64 [K], values float32 [K]), K distinct buckets."""
    tokens = _TOKEN.findall(text.lower())[:max_tokens]
    grams = tokens + [f"{a} {b}" for a, b in zip(tokens, tokens[1:], strict=False)]
    if not grams:
        return np.zeros(0, np.int64), np.zeros(0, np.float32)
    buckets = np.fromiter((zlib.crc32(gram.encode("utf-8")) for gram in grams), np.int64, len(grams)) % dims
    indices, counts = np.unique(buckets, return_counts=True)
    values = np.log1p(counts).astype(np.float32)
    return indices, values / np.linalg.norm(values)


def _feature_matrix(texts: Sequence[str], dims: int, max_tokens: int):
    """CSR matrix float32 [len(texts), dims]."""
    from scipy import sparse

    rows = [hashed_features(text, dims, max_tokens) for text in texts]
    indptr = np.cumsum([0] + [len(indices) for indices, _ in rows])
    indices = np.concatenate([indices for indices, _ in rows]) if rows else np.zeros(0, np.int64)
    values = np.concatenate([values for _, values in rows]) if rows else np.zeros(0, np.float32)
    return sparse.csr_matrix((values, indices, indptr), shape=(len(texts), dims))


def fit_logistic_regression(
    features, labels: np.ndarray, l2: float, progress: bool = False
) -> tuple[np.ndarray, float]:
    """Minimises mean log-loss + l2/2 |w|^2 with Newton-CG (Hessian-vector products are two sparse
    products; on 65k buckets it converges in ~10 steps, where scipy's L-BFGS-B spends ~0.1 s per step
    in its own bookkeeping).

    Args:
        features: CSR [N, D]; labels: {0, 1} [N]; l2: regularisation strength.
        progress: report the Newton steps on stderr.
    Returns:
        (weights float32 [D], bias).
    """
    from scipy.optimize import minimize

    count, dims = features.shape
    signs = 2.0 * labels - 1.0  # [N] in {-1, +1}

    def loss_and_grad(params):
        weights, bias = params[:dims], params[dims]
        margins = signs * (features @ weights + bias)  # [N]
        loss = np.logaddexp(0.0, -margins).mean() + 0.5 * l2 * weights @ weights
        coefficient = -signs / (1.0 + np.exp(margins)) / count  # d loss / d logit, [N]
        return loss, np.concatenate([features.T @ coefficient + l2 * weights, [coefficient.sum()]])

    def hessian_times(params, vector):
        probability = 1.0 / (1.0 + np.exp(-(features @ params[:dims] + params[dims])))  # [N]
        scaled = probability * (1.0 - probability) / count * (features @ vector[:dims] + vector[dims])  # [N]
        return np.concatenate([features.T @ scaled + l2 * vector[:dims], [scaled.sum()]])

    with Progress("quality: Newton-CG fit", None, "steps", progress) as bar:
        result = minimize(
            loss_and_grad,
            np.zeros(dims + 1),
            jac=True,
            hessp=hessian_times,
            method="Newton-CG",
            options={"maxiter": 100},
            callback=lambda params: bar.update(),
        )
    return result.x[:dims].astype(np.float32), float(result.x[dims])


def evaluate(model: QualityModel, examples: Sequence[tuple[str, int, str]], threshold: float = 0.5) -> dict:
    """How `score >= threshold` (kept as good) does on labelled examples (label 1 good, 0 junk).

    Returns:
        precision and recall of the "good" answer, the same for the "junk" answer (what the stage
        drops), accuracy against the constant that always answers the majority label, and the
        share of each junk kind caught.
    """
    scores = np.array([model.score(text) for text, _, _ in examples])
    good = np.array([label == 1 for _, label, _ in examples])
    kept = scores >= threshold

    def precision_recall(predicted, actual):
        hits = int((predicted & actual).sum())
        return hits / max(1, int(predicted.sum())), hits / max(1, int(actual.sum()))

    precision, recall = precision_recall(kept, good)
    junk_precision, junk_recall = precision_recall(~kept, ~good)
    kinds = sorted({kind for _, label, kind in examples if label == 0})
    return {
        "examples": len(good),
        "positives": int(good.sum()),
        "threshold": threshold,
        "precision": precision,
        "recall": recall,
        "junk_precision": junk_precision,
        "junk_recall": junk_recall,
        "accuracy": float((kept == good).mean()) if len(good) else 0.0,
        "constant_accuracy": float(max(good.mean(), 1 - good.mean())) if len(good) else 0.0,
        "junk_caught": {
            kind: float(
                np.mean(
                    [
                        not k
                        for k, (_, _, example_kind) in zip(kept, examples, strict=True)
                        if example_kind == kind
                    ]
                )
            )
            for kind in kinds
        },
    }


def train_model(
    positives,
    *,
    seed: int = 0,
    dims: int = DEFAULT_DIMS,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    l2: float = DEFAULT_L2,
    holdout_fraction: float = 0.2,
    progress: bool = False,
) -> QualityModel:
    """Trains the classifier on curated passages vs their synthetic junk; metrics are on the held-out part.

    Args:
        positives: Documents of curated passages (quality_data.positive_passages).
        seed, holdout_fraction: fix the negatives and the split; dims, max_tokens: the features;
        l2: regularisation; progress: say each step on stderr.
    Returns:
        the QualityModel, its `metrics` holding {"train": ..., "held_out": ...}.
    Raises:
        TrainingDataError: too few passages to train on and hold out a sample.
    """
    train, held_out = labelled_examples(positives, seed, holdout_fraction)
    if not train or not held_out:
        raise TrainingDataError(f"too few curated passages ({len(positives)}) to train and hold out a sample")
    if progress:
        say(f"quality: fitting on {len(train):,} examples ({len(held_out):,} held out), {dims:,} features")
    features = _feature_matrix([text for text, _, _ in train], dims, max_tokens)
    labels = np.array([label for _, label, _ in train], float)
    weights, bias = fit_logistic_regression(features, labels, l2, progress)
    model = QualityModel(weights, bias, max_tokens)
    metrics = {
        "train": evaluate(model, train),
        "held_out": evaluate(model, held_out),
        "positive_passages": len(positives),
        "dims": dims,
        "l2": l2,
        "seed": seed,
    }
    return dataclasses.replace(model, metrics=metrics)


def save_model(model: QualityModel, path: str | os.PathLike) -> None:
    """Writes the model as .npz (atomically: a temporary file, then rename)."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial.npz")
    np.savez_compressed(
        partial,
        weights=model.weights.astype(np.float32),
        bias=np.float64(model.bias),
        max_tokens=np.int64(model.max_tokens),
        metrics=np.array(json.dumps(model.metrics)),
    )
    partial.replace(path)


@functools.lru_cache(maxsize=4)
def _load(path: str, modified: int) -> QualityModel:
    with np.load(path) as data:
        return QualityModel(
            data["weights"], float(data["bias"]), int(data["max_tokens"]), json.loads(str(data["metrics"]))
        )


def load_model(path: str | os.PathLike) -> QualityModel:
    """The model saved at `path` (cached per process, reloaded when the file changes)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(
            f"no quality model at {path}; train one with "
            "`python -m glm5_jax.prepare.quality train --config ...`"
        )
    return _load(str(path), path.stat().st_mtime_ns)


def _check_positive_sources(settings: QualitySettings) -> None:
    if not settings.positive_sources:
        raise TrainingDataError("quality.positive_sources is empty: nothing to learn curated text from")


def train_from_settings(
    settings: QualitySettings,
    seed: int = 0,
    l2: float = DEFAULT_L2,
    max_passages: int = DEFAULT_MAX_PASSAGES,
    documents: Sequence[Document] | None = None,
    progress: bool = False,
) -> QualityModel:
    """Trains on (a deterministic sample of at most max_passages) curated passages of the config's
    quality.positive_sources.

    Args:
        settings: the quality section; seed, l2, max_passages: as train_model and the sample.
        documents: the positive sources' documents when the caller has read them already (the
            prepare run, when they are its own sources), else they are read here.
        progress: say each step (reading, passages, the fit) on stderr.
    Raises:
        TrainingDataError: no positive source, or too few curated passages in it.
    """
    _check_positive_sources(settings)
    if documents is None:
        documents = [document for _, document in scan_sources(settings.positive_sources, progress).documents]
    passages = []
    with Progress("quality: curated passages", len(documents), "docs", progress) as bar:
        for document in documents:  # a document at a time, for the count (ast-parsing ~2k files: ~10 s)
            passages.extend(positive_passages([document]))
            bar.update()
        bar.close(f"{len(passages):,} passages")
    if len(passages) > max_passages:
        rank = lambda passage: hashlib.sha256(f"{seed}\x00{passage.doc_id}".encode()).digest()
        passages = sorted(passages, key=rank)[:max_passages]
        if progress:
            say(f"quality: training on a fixed sample of {max_passages:,} passages")
    return train_model(passages, seed=seed, l2=l2, progress=progress)


def ensure_model(
    settings: QualitySettings,
    seed: int = 0,
    documents: Sequence[Document] | None = None,
    progress: bool = False,
) -> str | None:
    """The model path of the config, trained and saved first when the file does not exist yet (saying
    so on stderr); None when level 2 is off (model_path "").

    Args:
        settings, seed: the quality section and the training seed.
        documents, progress: as train_from_settings.
    Raises:
        TrainingDataError: the model is missing and its labelled data cannot be built.
    """
    if not settings.model_path:
        return None
    path = Path(settings.model_path).expanduser()
    if not path.is_file():
        _check_positive_sources(settings)
        say(f"quality: training the classifier (no model at {path} yet)")
        model = train_from_settings(settings, seed, documents=documents, progress=progress)
        save_model(model, path)
        say(f"quality: held-out {_summary(model.metrics['held_out'])}; saved {path}")
    return str(path)


def _summary(metrics: dict) -> str:
    return (
        f"precision {metrics['precision']:.3f} recall {metrics['recall']:.3f} (junk: precision "
        f"{metrics['junk_precision']:.3f} recall {metrics['junk_recall']:.3f}), accuracy "
        f"{metrics['accuracy']:.3f} vs constant {metrics['constant_accuracy']:.3f}, "
        f"{metrics['examples']} examples"
    )


def main(argv: Sequence[str] | None = None) -> None:
    from glm5_jax.prepare.config import load_prepare_config, settings_from_config

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train on the config's quality.positive_sources and save")
    train.add_argument("--config", required=True, help="a configs/data/*.py prepare config (PATH[:ARGUMENT])")
    train.add_argument("--output", default=None, help="model file (default: the config's quality.model_path)")
    train.add_argument("--seed", type=int, default=0, help="fixes the synthetic negatives and the split")
    train.add_argument("--l2", type=float, default=DEFAULT_L2, help="L2 regularisation strength")
    train.add_argument(
        "--max-passages",
        type=int,
        default=DEFAULT_MAX_PASSAGES,
        help="train on at most this many curated passages (a fixed sample)",
    )
    score = commands.add_parser("score", help="print the score of each file")
    score.add_argument("--model", required=True, help="a model file written by `train`")
    score.add_argument("files", nargs="+", help="text files to score")
    args = parser.parse_args(argv)
    if args.command == "score":
        model = load_model(args.model)
        for name in args.files:
            print(f"{model.score(Path(name).read_text(encoding='utf-8', errors='replace')):.4f}  {name}")
        return
    settings = settings_from_config(load_prepare_config(args.config))
    output = args.output or settings.quality.model_path
    if not output:
        raise SystemExit("error: give --output or set quality.model_path in the config")
    try:
        model = train_from_settings(settings.quality, args.seed, args.l2, args.max_passages, progress=True)
    except TrainingDataError as error:
        raise SystemExit(f"error: {error}") from None
    save_model(model, output)
    print(json.dumps(model.metrics, indent=2))
    print(f"held-out: {_summary(model.metrics['held_out'])}")
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
