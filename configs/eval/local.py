"""The local suite: three dimensions from material on every machine (this Python's standard
library and the replay sample shipped in glm5_jax/evaluate/data/), sized for a few minutes on a
CPU with the demo model. Override a size with --limit N (caps every task).

    python -m glm5_jax.evaluate --checkpoint runs/demo --suite local
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.name = "local"
    config.description = (
        "stdlib multiple choice and held-out text, stdlib doctests, arithmetic, a replay sample"
    )
    config.seed = 0
    config.max_length = 256  # tokens per log-likelihood row (the demo trains on 256)
    config.batch_size = 8
    # The in-process engine (code, exact match, replay); few shapes keep CPU compilation short.
    config.engine = dict(max_slots=4, max_context=512, token_budget=64, decode_steps=8, page_size=16)
    config.sandbox = dict(timeout_s=5.0, memory_mb=512, max_processes=16, max_file_mb=16)
    config.tasks = [
        # basic ability
        dict(name="stdlib_modules", kind="multiple_choice", source="builtin:stdlib_modules", limit=48),
        dict(
            name="stdlib_docstrings",
            kind="multiple_choice",
            source="builtin:stdlib_docstrings",
            limit=48,
            target_delimiter="",
        ),
        dict(
            name="stdlib_heldout",
            kind="bits_per_byte",
            source="builtin:stdlib_heldout",
            limit=8,
            max_document_bytes=3000,
        ),
        # professional ability
        dict(
            name="stdlib_doctests",
            kind="code",
            source="builtin:stdlib_doctests",
            limit=16,
            samples=1,
            k=[1],
            temperature=0.0,
            max_tokens=96,
            # HumanEval's stops, and two blank lines (no function body has them): a weak model's
            # run of empty lines ends there instead of at max_tokens.
            stop=["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\n@", "\n\n\n"],
        ),
        dict(
            name="arithmetic",
            kind="exact_match",
            source="builtin:arithmetic",
            limit=32,
            num_fewshot=4,
            max_tokens=8,
            stop=["\n"],
            prompt_template=">>> {question}\n",
            shot_template=">>> {question}\n{solution}\n",
        ),
        # real scenarios
        dict(
            name="replay_sample",
            kind="replay",
            source="package:replay_sample.jsonl",
            default_rules={"finish_reason": "stop"},
            concurrency=4,
        ),
    ]
    return config
