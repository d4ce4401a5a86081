"""NVFP4 for every feed-forward weight (dense MLP, routed and shared experts), FP8 block for
attention; embedding and LM head stay in the model's dtype."""

import ml_collections


def get_config():
    return ml_collections.ConfigDict({"formats": {
        "attention": "fp8", "indexer": "fp8", "mtp_projection": "fp8",
        "dense_mlp": "nvfp4", "routed_experts": "nvfp4", "shared_expert": "nvfp4",
    }})
