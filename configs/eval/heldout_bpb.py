"""Bits per byte on the demo run's whole held-out set: the 2% of standard-library files that
`configs/demo.py` (data.validation_fraction 0.02, seed 0) keeps out of training, as raw text, each
file whole. The prepared-vs-raw comparison of docs/data.md scores both models on it: prepared
documents keep their raw ids, so neither run trained on any of these files.

    python -m glm5_jax.evaluate --checkpoint runs/demo_raw --suite configs/eval/heldout_bpb.py
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.name = "heldout_bpb"
    config.description = "bits per byte on the demo run's held-out standard-library files (all, whole)"
    config.seed = 0
    config.max_length = 256  # tokens per rolling window: the demo trains on 256
    config.batch_size = 8
    config.tasks = [
        dict(
            name="stdlib_heldout",
            kind="bits_per_byte",
            source="builtin:stdlib_heldout",
            max_document_bytes=1_000_000,  # whole files (the largest held-out file has 111 kB)
        ),
    ]
    return config
