"""The embedded default: configs/base.py's ~10M-parameter model with the full GLM-5 structure (MLA,
DSA with index_topk below the sequence length, a dense prefix, MoE with a shared expert, an MTP
head), trained on this machine's Python standard-library sources. Runs in minutes on a laptop CPU.

    python train.py --config configs/demo.py
"""

from pathlib import Path

import ml_collections

from glm5_jax.pyconfig import load_config_file


def get_config() -> ml_collections.ConfigDict:
    config = load_config_file(Path(__file__).with_name("base.py"))
    # CPU tuning (float32 compute; use --config.execution.dtype=bfloat16 on accelerators).
    # A few layers: unrolled is ~5% faster per step on a CPU (bench/train_step.py).
    config.execution.scan_unroll = 8
    # Attention in blocks of 64 queries, each to its own end: faster, same loss.
    config.execution.causal_block_size = 64
    # On a CPU, padded per-expert blocks beat ragged_dot and the dense path.
    config.execution.moe_impl = "blocked"
    return config
