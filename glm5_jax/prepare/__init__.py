"""Data preparation: three levels of filtering, dedup, domain tagging, review and sharding.

    python -m glm5_jax.prepare --config configs/data/demo.py --output DIR [--review N]
        [--executor local|ray] [--workers K]
    python -m glm5_jax.prepare.quality train --config configs/data/demo.py

Level 1: normalisation, exact and near (MinHash LSH) dedup, Gopher/C4 text rules, code rules.
Level 2: a learned quality score (hashed n-gram logistic regression).
Level 3: domain tagging (code / prose / docs / other) and per-domain cleaning.
Optional: each kept document's difficulty (bits per byte under a reference model, --difficulty_checkpoint).
docs/data.md describes the stages, config keys, outputs and measured figures.

Public API:
    PrepareSettings, settings_from_config(config)      the checked config
    prepare(settings, output, *, executor, review=0, overwrite=False) -> stats dict
    LocalExecutor(workers), RayExecutor(workers), make_executor(kind, workers)
    read_prepared(path) -> iterator of records {"id", "text", "domain", "source", "quality"[, "difficulty"]}
"""

import importlib

# Attributes load on first use, so `python -m glm5_jax.prepare.quality` and the `prepared`
# source kind do not import the whole pipeline first.
_EXPORTS = {
    "PrepareConfigError": "config",
    "PrepareSettings": "config",
    "settings_from_config": "config",
    "LocalExecutor": "executors",
    "RayExecutor": "executors",
    "make_executor": "executors",
    "prepare": "run",
    "read_prepared": "writer",
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)


__all__ = sorted(_EXPORTS)
