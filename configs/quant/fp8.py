"""FP8 E4M3 with 128x128 block scales for every linear weight (as the published FP8 checkpoint);
embedding and LM head stay in the model's dtype."""

import ml_collections


def get_config():
    fp8 = ("attention", "indexer", "linear_attention", "dense_mlp", "routed_experts", "shared_expert",
           "mtp_projection")
    return ml_collections.ConfigDict({"formats": {name: "fp8" for name in fp8}})
