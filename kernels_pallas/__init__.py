"""Pallas kernels (TPU via Mosaic, NVIDIA GPUs via Triton), each beside its plain-jnp reference.

    common.py              backend choice, pallas_call options, lowering helper, KernelCase
    flash_attention.py     causal/segment/sliding-window flash attention, forward and backward
    dsa_indexer.py         DSA indexer scores fused with the top-k selection (radix select)
    sparse_attention.py    gathered top-k attention in absorbed-MLA form, forward and backward
    mla_decode.py          MLA attention over a paged latent cache (block table, optional top-k)
    ragged_paged_attention.py  MLA attention of a ragged token batch (decode + prefill chunks) over pages
    moe_grouped_matmul.py  grouped matmul over expert-sorted rows, forward and backward
    fp8_matmul.py          weight-only FP8 (128x128 block-scaled) matmul, tiles dequantized in-kernel
    kda.py                 chunked Kimi Delta Attention (gated delta rule), forward and backward

The model selects them per op (ExecutionOptions.attention_impl, indexer_impl, decode_attention_impl,
linear_attention_impl, moe_impl="pallas", quantized_matmul="pallas"); see docs/kernels.md.
"""
