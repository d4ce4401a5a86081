"""The source articles' recipe: FP8 (128x128 blocks) attention projections, NVFP4 routed experts
and FFN; the DSA indexer, the MTP projection, embedding and LM head stay in the model's dtype."""

import ml_collections


def get_config():
    return ml_collections.ConfigDict({"formats": {
        "attention": "fp8", "dense_mlp": "nvfp4", "routed_experts": "nvfp4", "shared_expert": "nvfp4",
    }})
