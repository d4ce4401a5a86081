"""Source code only: a directory tree read by extension, level 1 (dedup, code rules) and level 3
(licence headers stripped, blank runs cut); the learned quality score is off, since it judges prose.

    python -m glm5_jax.prepare --config configs/data/code.py:/path/to/repo --output data/prepared/code

The argument is the directory to walk (default: the current one).
"""

import ml_collections

EXTENSIONS = tuple(".py .pyi .c .h .cc .cpp .hpp .cu .js .ts .go .rs .java .sh".split())


def get_config(directory: str = ".") -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.sources = [dict(kind="code_dir", paths=[directory], name="code", extensions=EXTENSIONS)]
    config.dedup = dict(exact=True, near=True, ngram=5, num_perm=128, threshold=0.7, seed=1)
    config.code_rules = dict(max_line_length=1000, min_alphanumeric_fraction=0.25, marker_lines=20)
    config.quality = dict(model_path="")  # level 2 off: the classifier was trained on prose
    config.domains = dict(strip_license_headers=True, max_blank_lines_code=2)
    # Optional: each kept document's bits per byte under a reference model (a train.py run or HF
    # checkpoint), stored as `difficulty` for data.schedule; "" skips it (or --difficulty_checkpoint).
    config.difficulty = dict(checkpoint="", max_bytes=4000, max_length=256, batch_size=8)
    config.output = dict(docs_per_shard=1000)
    config.batch_docs = 32
    config.seed = 0
    return config
