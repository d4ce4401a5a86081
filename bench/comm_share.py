"""Communication share of the GLM-5 train step for several mesh layouts, in one table.

    python bench/comm_share.py --config configs/glm5.py --batch 64 --seq_len 4096 \\
        --layouts fsdp=8,expert=8,tensor=8 fsdp=8,expert=8,tensor=4 --out-dir /tmp/comm \\
        --set remat=full --set dtype=bfloat16 --set param_dtype=float32 ...
    python bench/comm_share.py --config configs/glm5.py --batch 64 --seq_len 4096 \\
        --from-hlo /tmp/comm/*.hlo --efficiency 1.0 0.4      # re-read saved programs, no compile

Each layout is compiled by `python -m glm5_jax.plan ... --save-hlo` in its own process (the fake
CPU devices must be set before JAX starts); a layout may carry its own overrides after "+", e.g.
`data=2,fsdp=4,expert=8,tensor=8+grad_reduce_dtype=bfloat16`. The saved per-device programs
(right after SPMD partitioning) are read by glm5_jax.parallel.collectives: bytes each device sends
per step by collective kind (ring formulas, loops counted; collectives inside Pallas kernels run
in interpret mode left out), and the communication fraction under each system's link model with
compute = 6 x active params x tokens at `efficiency` x peak. --top lists the largest contributors.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from glm5_jax.parallel import collectives  # noqa: E402  (no JAX import: parsing only)
from glm5_jax.parallel.mesh import MeshSpec  # noqa: E402


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="config file with a `model` section")
    parser.add_argument("--batch", type=int, required=True, help="global batch rows")
    parser.add_argument("--seq_len", type=int, default=4096, help="tokens per row")
    parser.add_argument(
        "--layouts",
        nargs="*",
        default=[],
        help="meshes to compile, e.g. fsdp=8,expert=8,tensor=8 (devices = their product); "
        "'+FIELD=VALUE' appends a layout-only override",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override for every layout (passed to glm5_jax.plan --set)",
    )
    parser.add_argument("--out-dir", default="comm_share_hlo", help="where the compiled programs are saved")
    parser.add_argument(
        "--from-hlo", nargs="*", default=[], help="saved programs to read instead of compiling"
    )
    parser.add_argument(
        "--efficiency",
        type=float,
        nargs="+",
        default=[1.0],
        help="fractions of peak FLOP/s for the compute time (one column each)",
    )
    parser.add_argument("--links", default="h200,v5p", help="systems (glm5_jax.parallel.collectives.SYSTEMS)")
    parser.add_argument("--top", type=int, default=0, help="list the N largest collectives per layout")
    return parser.parse_args(argv)


def compile_layout(args, layout: str, path: Path) -> None:
    mesh, *extra = layout.split("+")
    devices = math.prod(max(size, 1) for size in MeshSpec.parse(mesh).sizes_given())
    command = [
        sys.executable,
        "-m",
        "glm5_jax.plan",
        "--config",
        args.config,
        "--mesh",
        mesh,
        "--devices",
        str(devices),
        "--batch",
        str(args.batch),
        "--seq_len",
        str(args.seq_len),
        "--save-hlo",
        str(path),
        "--links",
        args.links,
    ]
    for item in [*args.set, *extra]:
        command += ["--set", item]
    started = time.perf_counter()
    run = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    if run.returncode:
        raise SystemExit(f"{layout}: plan failed\n{run.stderr[-3000:]}")
    print(f"compiled {layout} in {time.perf_counter() - started:.0f} s: {path}", file=sys.stderr)


def active_params(args) -> int:
    import dataclasses

    from glm5_jax.config_files import load_model_config, split_overrides
    from glm5_jax.model.count import count_params
    from glm5_jax.plan import _parse_value
    from glm5_jax.train.settings import TrainSettings

    train_fields = {f.name for f in dataclasses.fields(TrainSettings)}
    overrides = {k: _parse_value(v) for k, v in (item.split("=", 1) for item in args.set)}
    model_overrides, _ = split_overrides({k: v for k, v in overrides.items() if k not in train_fields})
    return count_params(load_model_config(args.config, **model_overrides))["active"]


def table(rows, systems, efficiencies) -> list[str]:
    """Markdown: GB per device per step by kind, then each system's comm time and fractions."""
    kinds = [k for k in collectives.KINDS if any(totals[k] for _, totals, _ in rows)]
    head = ["layout (devices)", *kinds, "total GB"]
    for key in systems:
        head.append(f"{key} comm ms")
        for e in efficiencies:
            head += [f"{key} compute ms @{e:.0%}", f"{key} share @{e:.0%} (serial / overlapped)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, totals, estimates in rows:
        cells = [
            f"`{name}`",
            *(f"{totals[k] / 1e9:.1f}" for k in kinds),
            f"**{sum(totals.values()) / 1e9:.1f}**",
        ]
        for key in systems:
            cells.append(f"{estimates[key][0].comm_seconds * 1e3:,.0f}")
            for estimate in estimates[key]:
                cells += [
                    f"{estimate.compute_seconds * 1e3:,.0f}",
                    f"{estimate.fraction_no_overlap:.0%} / {estimate.fraction_perfect_overlap:.0%}",
                ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    systems = [s for s in args.links.split(",") if s]
    paths = [Path(p) for p in args.from_hlo]
    if args.layouts:
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        for layout in args.layouts:
            path = out / (layout.replace(",", "_").replace("=", "").replace("+", "__") + ".hlo")
            compile_layout(args, layout, path)
            paths.append(path)
    if not paths:
        raise SystemExit("nothing to read: give --layouts or --from-hlo")
    active = active_params(args)
    tokens = args.batch * args.seq_len
    print(
        f"{active / 1e9:.1f}B active params x {tokens:,} tokens x 6 = {6 * active * tokens / 1e15:.1f} "
        "PFLOP per step (model FLOPs)"
    )
    rows = []
    for path in paths:
        text = path.read_text()
        found = collectives.parse_collectives(text)
        devices = collectives.parse_module(text).num_partitions
        flops = 6 * active * tokens / devices
        kept = collectives.counted(found)
        estimates = {
            key: [collectives.estimate(kept, flops, collectives.SYSTEMS[key], e) for e in args.efficiency]
            for key in systems
        }
        rows.append((f"{path.stem} ({devices})", collectives.bytes_by_kind(kept), estimates))
        skipped = sum(c.total_bytes for c in found if c.in_interpreted_kernel)
        if skipped:
            print(f"{path.stem}: left out {skipped / 1e9:.1f} GB inside interpreted Pallas kernels")
        for key in systems:
            links = ", ".join(
                f"{v / 1e9:.1f} GB over {name}" for name, v in estimates[key][0].bytes_by_link.items()
            )
            print(f"{path.stem} on {key}: {links}")
        for c in sorted(kept, key=lambda c: -c.total_bytes)[: args.top]:
            where = c.source[0].replace(str(ROOT) + "/", "") if c.source else "?"
            print(
                f"  {c.total_bytes / 1e9:8.2f} GB  {c.kind:<18} {c.dtype:<5} n={c.group_size:<4} "
                f"x{c.count:<6} {where:<36} {c.op_name[-70:]}"
            )
    print()
    print("\n".join(table(rows, systems, args.efficiency)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
