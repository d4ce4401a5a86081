"""An example server config for `python serve.py --server-config configs/serve_example.py`.

Model-id aliases, API keys and their per-minute limits (docs/serving.md). The same fields can be
given as a JSON object in a `.json` file. Limits: 0 = unlimited; a key without a limit of its own
gets default_limits. Keep secrets out of the file with `key_env` (the key is read from that
environment variable at start-up).
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.model_id = ""  # "" = --model-id, else the checkpoint directory's name
    config.model_aliases = ["glm-5", "glm-5-demo"]
    # With keys listed, only they are accepted; False also lets any other key (or none) in, at the
    # default limits, each key (and "no key") with its own window.
    config.require_api_key = True
    config.default_limits = {"requests_per_minute": 60, "tokens_per_minute": 20_000}
    config.api_keys = [
        # {"name": "team-a", "key_env": "TEAM_A_API_KEY", "requests_per_minute": 600,
        #  "tokens_per_minute": 200_000},
        # {"name": "batch-jobs", "key_env": "BATCH_API_KEY", "requests_per_minute": 0,
        #  "tokens_per_minute": 1_000_000},
    ]
    return config
