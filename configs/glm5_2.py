"""GLM-5.2: GLM-5's architecture with IndexShare (index_topk_freq=4, index_skip_topk_offset=3):
layers 0-2 and every 4th layer after run the DSA indexer, the others reuse its top-k."""

from pathlib import Path

import ml_collections

from glm5_jax.config_files import load_config_file
from glm5_jax.model.config import indexer_pattern


def get_config() -> ml_collections.ConfigDict:
    config = load_config_file(Path(__file__).with_name("glm5.py"))
    config.model.indexer_types = list(indexer_pattern(config.model.num_layers, frequency=4,
                                                      offset=3))
    return config
