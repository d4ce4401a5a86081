"""int8 with a symmetric scale per output channel for every linear weight; embedding and LM head
stay in the model's dtype."""

import ml_collections


def get_config():
    int8 = ("attention", "indexer", "dense_mlp", "routed_experts", "shared_expert", "mtp_projection")
    return ml_collections.ConfigDict({"formats": {name: "int8" for name in int8}})
