"""Weight quantization: FP8 E4M3 block-scaled, NVFP4, int8 per channel; recipes per module class.

    params = quantize_params(params, "mixed")    # QuantizedTensor leaves where the recipe says
    forward(config, params, ids)                 # layers dequantize per layer (declare_weight)
    linear(x, params_layer["q_a_proj"], "pallas")  # the serving step: fp8 stays fp8 (quant.matmul)

See docs/quantization.md.
"""

from glm5_jax.quant.formats import (
    FORMATS,
    QuantizationError,
    QuantizedTensor,
    dequantize,
    dequantize_tree,
    is_quantized,
    quantize,
)
from glm5_jax.quant.matmul import IMPLS as MATMUL_IMPLS
from glm5_jax.quant.matmul import expert_linear, head_inputs, head_outputs, linear
from glm5_jax.quant.recipes import (
    MODULE_CLASSES,
    Recipe,
    builtin_recipes,
    format_counts,
    load_recipe,
    quantize_params,
    weight_bytes,
    weight_layout,
)

__all__ = [
    "FORMATS", "MATMUL_IMPLS", "MODULE_CLASSES", "QuantizationError", "QuantizedTensor", "Recipe",
    "builtin_recipes", "dequantize", "dequantize_tree", "expert_linear", "format_counts", "head_inputs",
    "head_outputs", "is_quantized", "linear", "load_recipe", "quantize", "quantize_params", "weight_bytes",
    "weight_layout",
]
