"""Pallas kernels (TPU via Mosaic, NVIDIA GPUs via Triton), each beside its plain-jnp reference.

Empty until the kernels issue lands: the model's jnp formulations in glm5_jax/model are the
references those kernels will be tested against.
"""
