"""GLM-5.3-Flash's architecture at demo size (configs/demo.py's ~10M-parameter scale): KDA linear
attention on three of four layers, MLA with NoPE and pooled DSA (pools of 4, index_topk below the
sequence length) on the fourth, four hyper-connection streams, clamped SwiGLU, a dense first layer
and MoE after it; trained on this machine's Python standard-library sources.

    python train.py --config configs/glm5_next_demo.py
"""

from pathlib import Path

import ml_collections

from glm5_jax.pyconfig import load_config_file


def get_config() -> ml_collections.ConfigDict:
    config = load_config_file(Path(__file__).with_name("demo.py"))
    config.model.update(dict(
        qk_nope_head_dim=48,
        qk_rope_head_dim=0,
        rope_theta=1_000_000.0,  # unused (NoPE); the value a glm5_next config.json reads back as
        attention_types=["linear", "linear", "linear", "dsa"],
        num_mtp_layers=0,
        linear_num_heads=4,
        linear_head_dim=32,
        linear_conv_kernel_dim=4,
        linear_lower_bound=-5.0,
        hc_mult=4,
        hc_sinkhorn_iters=20,
        hc_eps=1e-6,
        index_kpool=4,
        index_kpool_always_select_tail=True,
        swiglu_limit=10.0,
    ))
    # KDA's chunked delta rule in chunks of 64 positions (a lax.scan over the chunks).
    config.execution.linear_chunk_size = 64
    return config
