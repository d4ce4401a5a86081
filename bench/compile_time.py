"""Compile time of the jitted forward and forward+backward at two depths (scan keeps it flat).

    python bench/compile_time.py [--depths 4 32] [--seq-len 64]
"""

import argparse
import time

import jax
import jax.numpy as jnp

import glm5_jax
from glm5_jax.config_files import load_model_config
from glm5_jax.model import param_shapes


def loss(config, params, ids):
    logits = glm5_jax.forward(config, params, ids)
    return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])


def seconds_to_compile(fn, *args) -> float:
    start = time.perf_counter()
    fn.lower(*args).compile()
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny.py", help="model config file")
    parser.add_argument("--depths", type=int, nargs="+", default=[4, 32], help="num_layers values")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per row")
    args = parser.parse_args()

    print(f"jax {jax.__version__}, backend {jax.default_backend()}, config {args.config}")
    print("| layers | forward compile (s) | forward+backward compile (s) |")
    print("|---|---|---|")
    for depth in args.depths:
        config = load_model_config(args.config, num_layers=depth, indexer_types=[],
                                   attention_types=[])
        params = param_shapes(config)
        ids = jax.ShapeDtypeStruct((2, args.seq_len), jnp.int32)
        forward = jax.jit(glm5_jax.forward, static_argnums=0)
        backward = jax.jit(jax.value_and_grad(loss, argnums=1), static_argnums=0)
        print(f"| {depth} | {seconds_to_compile(forward, config, params, ids):.2f} | "
              f"{seconds_to_compile(backward, config, params, ids):.2f} |")


if __name__ == "__main__":
    main()
