"""Plan a run ahead of time: compile the full train step (or the serving engine's paged decode step)
for a mesh of
fake CPU devices on abstract inputs (nothing is allocated) and report per-device memory.

    python -m glm5_jax.plan --config configs/glm5.py --mesh fsdp=16,expert=16 --devices 256 \\
        --batch 256 --seq_len 4096
    python -m glm5_jax.plan --config configs/glm5.py --mesh fsdp=4,context=8,expert=4,tensor=4 \\
        --devices 512 --batch 16 --seq_len 131072     # context parallelism: sequences split 8 ways
    python -m glm5_jax.plan --config configs/glm5.py --mesh expert=16,tensor=2 --devices 32 \\
        --serve --batch 64 --context 32768

Params, optimizer state (or the decode cache) are counted from their shardings; activations and
other temporaries come from the compiled executable's memory analysis (XLA:CPU's buffer
assignment for the per-device program: a close proxy for GPU/TPU, which fuse differently).

Communication: the bytes each device sends per step, per collective kind, read from the program
right after SPMD partitioning (glm5_jax.parallel.collectives: ring formulas, loop trip counts),
and the communication fraction of the step under a link model (--links) with compute time from
6 x active params x tokens (2 x for --serve) at --compute-efficiency of the peak FLOP/s.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

GIB = 1024**3


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m glm5_jax.plan", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="config file with a `model` section")
    parser.add_argument("--mesh", required=True, help="axis sizes, e.g. fsdp=16,expert=16 (one may be -1)")
    parser.add_argument("--devices", type=int, default=0, help="fake CPU devices (default: mesh product)")
    parser.add_argument("--batch", type=int, default=0, help="global batch rows (train) or sequences (serve)")
    parser.add_argument("--seq_len", type=int, default=4096, help="train sequence length")
    parser.add_argument("--serve", action="store_true", help="plan the serving decode step instead")
    parser.add_argument("--context", type=int, default=32768, help="serve: cache length per sequence")
    parser.add_argument("--page-size", type=int, default=64, help="serve: positions per cache page")
    parser.add_argument("--quantize", default=None, metavar="RECIPE",
                        help="serve: weights quantized with this recipe (e.g. fp8: 128x128 block scales), "
                             "placed as serve.py --mesh places them")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="override a model field or an execution option (routed by name), e.g. "
                             "--set remat=full or --set num_layers=4 (repeatable)")
    parser.add_argument("--top", type=int, default=8, help="how many of the largest tensors to list")
    parser.add_argument("--buffers", type=int, default=0,
                        help="also list the N largest values in the compiled per-device program")
    parser.add_argument("--processes", type=int, default=1,
                        help="processes (hosts) the devices belong to, in order: devices / processes per "
                             "host (a node of 8 H200s, a v5p host of 4 chips). Reports which mesh axes cross "
                             "hosts and the bytes each step sends across hosts and inside them (default: 1)")
    parser.add_argument("--links", default="h200,v5p",
                        help="systems for the communication estimate (collectives.SYSTEMS): h200 "
                             "(NVLink 4 in a node of 8, InfiniBand 400 Gb/s across), v5p (ICI)")
    parser.add_argument("--compute-efficiency", type=float, default=1.0,
                        help="fraction of peak FLOP/s the compute reaches (1.0 = peak: the largest "
                             "communication share)")
    parser.add_argument("--save-hlo", default="", metavar="PATH",
                        help="write the partitioned per-device HLO (what the communication is read from)")
    return parser.parse_args(argv)


def _parse_value(text: str):
    if text.startswith("["):
        return json.loads(text)
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def _fmt(nbytes: float) -> str:
    if nbytes < GIB:
        return f"{nbytes / 1024**2:8.2f} MiB"
    return f"{nbytes / GIB:8.2f} GiB"


def _largest(abstract, shardings, top: int):
    import jax

    rows = []
    for (path, leaf), sharding in zip(jax.tree_util.tree_leaves_with_path(abstract),
                                      jax.tree.leaves(shardings), strict=True):
        shard = sharding.shard_shape(leaf.shape)
        size = leaf.dtype.itemsize
        for dim in shard:
            size *= dim
        name = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        rows.append((size, name, leaf.shape, leaf.dtype, sharding.spec))
    rows.sort(key=lambda row: -row[0])
    return rows[:top]


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from glm5_jax.parallel.mesh import MeshError, MeshSpec  # importing JAX does not start a backend

    try:
        spec = MeshSpec.parse(args.mesh)
    except MeshError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    devices = args.devices or math.prod(max(size, 1) for size in spec.sizes_given())
    if args.processes < 1 or devices % args.processes:
        print(f"error: --processes {args.processes} must be >= 1 and divide the {devices} devices",
              file=sys.stderr)
        return 2
    # Must happen before JAX creates its CPU backend. XLA:CPU computes bf16 dots in float32 and
    # loop-invariant code motion would then hoist float32 copies of every layer's weights out of
    # the layer loop, a CPU-only artifact that would dominate the temporaries; keep it off. Its
    # all-reduce-promotion (bf16 all-reduces computed in f32) aborts on the reducer JAX emits for
    # a bf16 psum inside shard_map (the Pallas kernels' backward under a mesh); keep that off too.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={devices}"
                               + " --xla_disable_hlo_passes=while-loop-invariant-code-motion"
                               + ",all-reduce-promotion")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import jax

    from glm5_jax.config_files import load_execution_options, load_model_config, split_overrides
    from glm5_jax.model.config import ConfigError, mesh_requirements
    from glm5_jax.model.count import count_params
    from glm5_jax.parallel import collectives, sharding
    from glm5_jax.parallel.mesh import axes_across_processes, make_mesh
    from glm5_jax.train.settings import TrainSettings

    try:
        overrides = {k: _parse_value(v) for k, v in (item.split("=", 1) for item in args.set)}
        train_fields = {f.name for f in dataclasses.fields(TrainSettings)}
        settings_overrides = {k: v for k, v in overrides.items() if k in train_fields}
        model_overrides, execution_overrides = split_overrides(
            {k: v for k, v in overrides.items() if k not in train_fields or k == "dsa_stage"})
        config = load_model_config(args.config, **model_overrides)
        options = load_execution_options(args.config, **execution_overrides)
        mesh = make_mesh(spec, mesh_requirements(config), jax.devices()[:devices])
        systems = [name for name in args.links.split(",") if name]
        unknown = [name for name in systems if name not in collectives.SYSTEMS]
        if unknown:
            raise ValueError(f"unknown --links {unknown[0]!r}; known: {', '.join(collectives.SYSTEMS)}")
    except (ConfigError, MeshError, ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    rules = sharding.DEFAULT_RULES
    counts = count_params(config)
    print(f"model: {counts['total'] / 1e9:.1f}B params ({counts['active'] / 1e9:.1f}B active); "
          f"dtype {options.dtype}, params {options.param_dtype}, remat {options.remat}, "
          f"moe_impl {options.moe_impl}, capacity factor {options.expert_capacity_factor or 'dropless'}")
    axes = ", ".join(f"{name}={size}" for name, size in mesh.shape.items())
    print(f"mesh: {axes} ({devices} devices)")
    per_host = devices // args.processes
    if args.processes > 1:
        across, within = axes_across_processes(mesh, lambda device: device.id // per_host)
        print(f"processes: {args.processes} of {per_host} devices; across processes: "
              f"{', '.join(across) or 'no axis'}; within a process: {', '.join(within) or 'no axis'}")
    started = time.perf_counter()
    try:
        if args.serve:
            report, compiled, hlo, tokens = _plan_serve(args, config, options, mesh, rules)
        else:
            report, compiled, hlo, tokens = _plan_train(args, config, options, mesh, rules,
                                                        settings_overrides)
    except (ConfigError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"compiled in {time.perf_counter() - started:.0f} s")
    for line in report:
        print(line)
    if args.buffers:
        print("\nlargest values in the compiled per-device program (not all live at once):")
        for line in largest_buffers(compiled.as_text(), args.buffers):
            print(line)
    if args.save_hlo:
        with open(args.save_hlo, "w") as file:
            file.write(hlo)
    passes = 2 if args.serve else 6  # forward only, or forward + backward
    flops = passes * counts["active"] * tokens / mesh.size
    note = (f" ({passes} x {counts['active'] / 1e9:.1f}B active params x {tokens:,} tokens / {mesh.size} "
            f"devices; the partitioned program's matmuls: {collectives.dot_flops(hlo) / 1e12:,.3g} TFLOP)")
    for line in communication_lines(collectives.parse_collectives(hlo), flops, systems,
                                    args.compute_efficiency, note, per_host if args.processes > 1 else 0):
        print(line)
    return 0


def _size(nbytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


def communication_lines(found, flops_per_device: float, systems, efficiency: float = 1.0,
                        flops_note: str = "", per_host: int = 0) -> list[str]:
    """Bytes sent per device per step by collective kind, and the communication share of the step
    on each system (glm5_jax.parallel.collectives); with per_host (devices per process), also the
    bytes whose collective groups span processes vs those that stay inside one."""
    from glm5_jax.parallel import collectives

    kept = collectives.counted(found)
    lines = ["", "communication per device per step (partitioned HLO, ring formulas, loops counted):",
             f"  {'kind':<20}{'ops':>6}{'executions':>12}{'sent':>12}  dtypes (share of bytes)"]
    for kind in collectives.KINDS:
        mine = [c for c in kept if c.kind == kind]
        if not mine:
            continue
        dtypes: dict[str, float] = {}
        for c in mine:
            dtypes[c.dtype] = dtypes.get(c.dtype, 0.0) + c.total_bytes
        total = sum(dtypes.values()) or 1.0
        shown = ", ".join(f"{d} {v / total:.0%}" for d, v in sorted(dtypes.items(), key=lambda kv: -kv[1]))
        lines.append(f"  {kind:<20}{len(mine):>6}{sum(c.count for c in mine):>12}"
                     f"{_size(sum(c.total_bytes for c in mine)):>12}  {shown}")
    lines.append(f"  {'total':<38}{_size(sum(c.total_bytes for c in kept)):>12}")
    skipped = [c for c in found if c.in_interpreted_kernel]
    if skipped:
        lines.append(f"  (left out: {_size(sum(c.total_bytes for c in skipped))} in {len(skipped)} "
                     "collectives inside Pallas kernels, which XLA:CPU runs as partitioned HLO loops in "
                     "interpret mode)")
    if per_host:
        spans = [c for c in kept if any(len({d // per_host for d in group}) > 1 for group in c.groups)]
        across = sum(c.total_bytes for c in spans)
        lines.append(f"  across processes {_size(across)}, inside one "
                     f"{_size(sum(c.total_bytes for c in kept) - across)} ({per_host} devices per process)")
    lines.append(f"compute: {flops_per_device / 1e12:,.3g} TFLOP per device{flops_note}")
    for key in systems:
        system = collectives.SYSTEMS[key]
        result = collectives.estimate(kept, flops_per_device, system, efficiency)
        links = "; ".join(f"{_size(v)} over {name}" for name, v in result.bytes_by_link.items())
        lines.append(f"{key} ({system.name}; compute at {efficiency:.0%} of peak): "
                     f"{links or 'no communication'}")
        lines.append(f"  comm {result.comm_seconds * 1e3:,.4g} ms, "
                     f"compute {result.compute_seconds * 1e3:,.4g} ms: communication "
                     f"{result.fraction_no_overlap:.1%} of the step without overlap, "
                     f"{result.fraction_perfect_overlap:.1%} exposed with perfect overlap")
    return lines


_ITEMSIZE = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "s64": 8, "s32": 4, "u32": 4, "s8": 1, "u8": 1,
             "pred": 1, "f8e4m3fn": 1}


def largest_buffers(hlo_text: str, count: int) -> list[str]:
    """The `count` largest instruction results of a compiled HLO module, with their op names."""
    import re

    rows = []
    for line in hlo_text.splitlines():
        match = re.match(r"\s*(?:ROOT )?%[\w.\-]+ = (\w+)\[([\d,]*)\]", line)
        if not match or match.group(1) not in _ITEMSIZE:
            continue
        size = _ITEMSIZE[match.group(1)]
        for dim in filter(None, match.group(2).split(",")):
            size *= int(dim)
        name = re.search(r'op_name="([^"]+)"', line)
        rows.append((size, f"{match.group(1)}[{match.group(2)}]", name.group(1) if name else ""))
    rows.sort(key=lambda row: -row[0])
    return [f"  {_fmt(size)}  {shape:<30} {name[-100:]}" for size, shape, name in rows[:count]]


def _memory_lines(compiled, parts: dict[str, float]) -> list[str]:
    analysis = compiled.memory_analysis()
    temp = float(analysis.temp_size_in_bytes)
    arguments = float(analysis.argument_size_in_bytes)
    outputs = float(analysis.output_size_in_bytes)
    aliased = float(getattr(analysis, "alias_size_in_bytes", 0))
    lines = ["", "per-device memory:"]
    for name, value in parts.items():
        lines.append(f"  {name:<34}{_fmt(value)}")
    lines.append(f"  {'activations + temporaries (XLA)':<34}{_fmt(temp)}")
    peak = arguments + outputs - aliased + temp
    lines.append(f"  {'arguments (compiled)':<34}{_fmt(arguments)}")
    lines.append(f"  {'outputs not aliased to inputs':<34}{_fmt(outputs - aliased)}")
    lines.append(f"  {'total (arguments + outputs + temp)':<34}{_fmt(peak)}")
    return lines


def _plan_train(args, config, options, mesh, rules, settings_overrides):
    """Returns (report lines, compiled step, partitioned HLO text, tokens per step)."""
    import jax
    import jax.numpy as jnp

    from glm5_jax.model.transformer import param_shapes
    from glm5_jax.parallel import collectives, sharding
    from glm5_jax.train.optimizer import make_optimizer
    from glm5_jax.train.settings import TrainSettings
    from glm5_jax.train.step import init_train_state, make_train_step, train_state_shardings

    batch_rows = args.batch or mesh.size
    settings = TrainSettings(**{"batch_size": batch_rows, **settings_overrides})
    settings.validate()
    optimizer = make_optimizer(settings)
    state_sharding = train_state_shardings(config, optimizer, mesh, rules, options=options)
    shapes = param_shapes(config, options=options)
    abstract_state = jax.eval_shape(lambda: init_train_state(
        jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), optimizer))
    state_in = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            abstract_state, state_sharding)
    batch_shard = sharding.batch_sharding(mesh, rules)
    field = jax.ShapeDtypeStruct((batch_rows, args.seq_len), jnp.int32, sharding=batch_shard)
    batch = {"input_ids": field, "positions": field, "segment_ids": field}
    step = make_train_step(config, settings, optimizer, mesh, rules, options=options)
    with sharding.activate(mesh, rules):
        compiled, hlo = collectives.compile_partitioned(step.jitted.trace(state_in, batch).lower())
    params_bytes = sharding.bytes_per_device(abstract_state.params, state_sharding.params)
    opt_bytes = sharding.bytes_per_device(abstract_state.opt_state, state_sharding.opt_state)
    context = mesh.shape.get("context", 1)
    lines = [f"train step: batch {batch_rows} x {args.seq_len} tokens "
             f"({batch_rows * args.seq_len / mesh.size:,.0f} tokens per device on average), "
             f"{settings.grad_accum_steps} microbatch(es), gradients reduced by "
             f"{settings.grad_reduce_dtype or 'XLA where computed'}"]
    if context > 1:
        lines.append(f"context parallelism: each sequence split over context={context}, "
                     f"{args.seq_len // context:,} positions per device")
    grad_bytes = params_bytes / options.weight_dtype(0).itemsize * 4  # accumulated in float32
    lines += _memory_lines(compiled, {"params": params_bytes, "optimizer state": opt_bytes,
                                      "gradients (f32, same sharding)": grad_bytes})
    lines += ["", f"largest parameters per device (of {len(jax.tree.leaves(abstract_state.params))}):"]
    for size, name, shape, dtype, spec in _largest(abstract_state.params, state_sharding.params, args.top):
        lines.append(f"  {_fmt(size)}  {name} {tuple(shape)} {dtype.name} -> {spec}")
    return lines, compiled, hlo, batch_rows * args.seq_len


def _plan_serve(args, config, options, mesh, rules):
    """The step serve.py runs at steady state on this mesh (glm5_jax.engine.runner): one paged
    decode step of `batch` sequences whose block tables cover `context` positions, on a page
    pool holding all of them; weights placed by SERVING_RULES (optionally quantized), the pool
    and the step's inputs replicated, as the runner places them."""
    del rules  # serving has its own rules
    import jax
    import jax.numpy as jnp

    from glm5_jax.model.paged_decode import (
        DEFAULT_BLOCK_POSITIONS,
        StepBatch,
        init_paged_cache,
        paged_cache_bytes_per_page,
        paged_step,
        serving_layout,
        state_bytes_per_sequence,
    )
    from glm5_jax.model.transformer import param_logical_axes, param_shapes
    from glm5_jax.parallel import collectives, sharding
    from glm5_jax.quant import load_recipe, quantize_params

    rules = sharding.SERVING_RULES
    batch_rows = args.batch or mesh.size
    page_size = args.page_size
    block_pages = max(1, DEFAULT_BLOCK_POSITIONS // page_size)  # as the engine's runner
    table_width = -(-args.context // (page_size * block_pages)) * block_pages
    num_pages = batch_rows * table_width
    params = param_shapes(config, options=options)
    if args.quantize:
        recipe = load_recipe(args.quantize)
        params = jax.eval_shape(lambda p: quantize_params(p, recipe), params)
    params_sharding = sharding.serving_param_shardings(param_logical_axes(config), mesh, params)
    params_in = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                             params, params_sharding)
    params_in = serving_layout(config, params_in, options)  # as the engine's runner holds them
    # The plan is for accelerators (on fake CPU devices): their pools keep the compute dtype.
    hybrid = config.has_linear_layers  # a state pool of one slot per sequence
    cache = jax.eval_shape(lambda: init_paged_cache(config, num_pages, page_size, options.compute_dtype,
                                                    on_cpu=False, state_slots=batch_rows if hybrid else 0))
    whole = sharding.replicated(mesh)
    cache_shardings = jax.tree.map(lambda leaf: whole, cache)  # every device's heads read the latent
    cache_in = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=whole), cache)
    vector = jax.ShapeDtypeStruct((batch_rows,), jnp.int32, sharding=whole)
    empty = jax.ShapeDtypeStruct((0, 0), jnp.int32, sharding=whole)
    tables = jax.ShapeDtypeStruct((batch_rows, table_width), jnp.int32, sharding=whole)
    batch = StepBatch(vector, vector, empty, empty, tables)
    with sharding.activate(mesh, rules):
        step = getattr(paged_step, "__wrapped__", paged_step)
        jitted = jax.jit(step, static_argnums=0, static_argnames=("options", "block_pages"), donate_argnums=2)
        compiled, hlo = collectives.compile_partitioned(jitted.trace(
            config, params_in, cache_in, batch, vector, options=options, block_pages=block_pages).lower())
    params_bytes = sharding.bytes_per_device(params, params_sharding)
    cache_bytes = sharding.bytes_per_device(cache, cache_shardings)
    per_token = paged_cache_bytes_per_page(config, page_size, options.compute_dtype, on_cpu=False) / page_size
    weights = f"weights ({args.quantize or options.param_dtype})"
    lines = [f"paged decode step: {batch_rows} sequences x 1 new token, {args.context} cached positions each "
             f"({num_pages} pages of {page_size}; {per_token / 1024:.1f} KiB per token, replicated)"]
    parts = {weights: params_bytes, "latent page pool": cache_bytes}
    if hybrid:
        state = state_bytes_per_sequence(config, options.compute_dtype, on_cpu=False)
        parts = {weights: params_bytes, "latent page pool": cache_bytes - batch_rows * state,
                 "KDA state pool": batch_rows * state}
        lines.append(f"KDA state: {state / 2**20:.1f} MiB per sequence at any length "
                     f"(= {state / per_token:,.0f} tokens of pages); of a sequence's cache: " + ", ".join(
                         f"{state / (state + per_token * length):.1%} at {length // 1024}K"
                         for length in (131072, 1048576)))
    lines += _memory_lines(compiled, parts)
    lines += ["", "largest parameters per device:"]
    for size, name, shape, dtype, spec in _largest(params, params_sharding, args.top):
        lines.append(f"  {_fmt(size)}  {name} {tuple(shape)} {dtype.name} -> {spec}")
    return lines, compiled, hlo, batch_rows


if __name__ == "__main__":
    sys.exit(main())
