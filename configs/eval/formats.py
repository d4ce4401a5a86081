"""The standard formats, on the small sample files shipped in glm5_jax/evaluate/data/: copy this
file and point `source` at your own MMLU / C-Eval CSV, lm-evaluation-harness JSONL, HumanEval
JSONL, GSM8K JSONL, text files or request logs (paths are relative to this file, or absolute;
globs and comma-separated lists work).

    python -m glm5_jax.evaluate --checkpoint runs/demo --suite formats
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.name = "formats"
    config.max_length = 256
    config.batch_size = 8
    config.engine = dict(max_slots=4, max_context=512, token_budget=64)
    config.sandbox = dict(timeout_s=5.0, memory_mb=512)
    config.tasks = [
        dict(name="mmlu_sample", kind="multiple_choice", source="package:mmlu_sample.csv"),  # format mmlu_csv
        dict(name="lm_eval_sample", kind="multiple_choice", source="package:lm_eval_sample.jsonl"),
        # text: plain files are one document each; JSONL files give one per line (`text_field`)
        dict(
            name="prompt_text",
            kind="bits_per_byte",
            source="package:humaneval_sample.jsonl",
            text_field="prompt",
        ),
        dict(
            name="humaneval_sample",
            kind="code",
            source="package:humaneval_sample.jsonl",
            samples=2,
            k=[1, 2],
            temperature=0.8,
            max_tokens=64,
        ),
        dict(
            name="gsm8k_sample",
            kind="exact_match",
            source="package:gsm8k_sample.jsonl",
            num_fewshot=1,
            max_tokens=48,
        ),
        dict(
            name="replay_sample",
            kind="replay",
            source="package:replay_sample.jsonl",
            max_tokens=32,
            temperature=0.0,
        ),
    ]
    return config
