"""The demo corpus through the prepare pipeline: this machine's Python standard library (plus
Debian's python3-doc reST sources when installed), the same text `configs/demo.py` trains on.

    python -m glm5_jax.prepare --config configs/data/demo.py --output data/prepared/demo --review 5
    python -m glm5_jax.prepare --config configs/data/demo.py:'/path/to/_sources/**/*.txt' ...

The optional argument is a glob of extra documentation (e.g. python3-doc's reST sources unpacked
somewhere other than /usr/share/doc), read as a `files` source. Thresholds: docs/data.md.
"""

import ml_collections


def get_config(doc_glob: str = "") -> ml_collections.ConfigDict:
    sources = [dict(kind="python_stdlib", name="python_stdlib")]
    if doc_glob:
        sources.append(dict(kind="files", paths=[doc_glob], name="python_docs"))
    config = ml_collections.ConfigDict()
    config.sources = sources
    config.dedup = dict(exact=True, near=True, ngram=5, num_perm=128, threshold=0.7, seed=1)
    # Gopher / C4 thresholds (glm5_jax/prepare/config.py); None turns a rule off.
    config.text_rules = dict(
        min_words=50,
        max_words=100_000,
        min_mean_word_length=3.0,
        max_mean_word_length=10.0,
        max_symbol_word_ratio=0.1,
        max_bullet_line_fraction=0.9,
        max_ellipsis_line_fraction=0.3,
        min_alpha_word_fraction=0.8,
        min_stop_words=2,
        max_duplicate_line_fraction=0.3,
        max_duplicate_paragraph_fraction=0.3,
        max_duplicate_line_char_fraction=0.2,
        max_duplicate_paragraph_char_fraction=0.2,
        max_top_ngram_char_fraction=(0.20, 0.18, 0.16),
        max_duplicate_ngram_char_fraction=(0.15, 0.14, 0.13, 0.12, 0.11, 0.10),
        lorem_ipsum=True,
        curly_braces=True,
        javascript_notice=True,
    )
    config.code_rules = dict(
        max_line_length=1000,
        min_alphanumeric_fraction=0.25,
        marker_lines=20,
        # generated_markers: the defaults of glm5_jax/prepare/config.py (regular expressions)
    )
    config.quality = dict(
        model_path="~/.cache/glm5_jax/quality-demo.npz",  # trained on first use (or: quality train)
        threshold=0.5,
        domains=("prose", "docs", "other"),
        positive_sources=sources,
    )  # curated text: the stdlib's docstrings and the reST docs
    config.domains = dict(strip_license_headers=True, max_blank_lines_code=2, max_blank_lines_text=1)
    # Optional: each kept document's bits per byte under a reference model (a train.py run or HF
    # checkpoint), stored as `difficulty` for data.schedule; "" skips it (or --difficulty_checkpoint).
    config.difficulty = dict(checkpoint="", max_bytes=4000, max_length=256, batch_size=8)
    config.output = dict(docs_per_shard=1000)
    config.batch_docs = 32
    config.seed = 0
    config.tokenizer_path = ""  # "" counts whitespace-separated words as tokens
    return config
