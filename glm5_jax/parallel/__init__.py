"""Sharding vocabulary: the logical axis names carried by weights and activations.

The model annotates weights with these names and calls `constrain` on activations; which mesh
axis each name maps to is decided outside the model (a rules table), so the math never mentions
devices. With no rules in context `constrain` is a no-op.

    logical.py   AXIS_NAMES, constrain, shards (how many ways the rules split a logical axis)
    mesh.py      MeshSpec, make_mesh (the mesh from the config; the `context` axis splits
                 sequences: context parallelism, model/mla.py)
    distributed.py  initialize_distributed (jax.distributed from the launcher's or a cluster's
                 environment, with its timeouts), barrier, any_process, exit_at_once_on_error
    sharding.py  DEFAULT_RULES, param/optimizer/batch shardings, activate(mesh, rules)
    expert.py    expert parallelism: shard_map + all_to_all (or ragged_all_to_all) dispatch
    pipeline.py  GPipe pipeline over the `pipeline` axis (ppermute inside shard_map)
    local.py     run_local: a kernel call on each device's own shard (shard_map by logical axes)

Only logical.py is imported here (the model imports it; the rest imports the model).
"""

from glm5_jax.parallel.logical import AXIS_NAMES, constrain, shards

__all__ = ["AXIS_NAMES", "constrain", "shards"]
