"""Communication per step, read from a compiled (post-SPMD-partitioning) HLO module's text.

    from glm5_jax.parallel import collectives
    compiled, hlo = collectives.compile_partitioned(jax.jit(f).lower(...))
    found = collectives.parse_collectives(hlo)
    estimate = collectives.estimate(found, flops_per_device, collectives.SYSTEMS["h200"])
    (glm5_jax.plan prints the report; bench/comm_share.py tabulates layouts)

Every collective instruction (all-reduce, all-gather, reduce-scatter, all-to-all,
collective-permute, ragged-all-to-all, and their async -start forms) is counted with its operand
bytes, its replica groups (explicit `{{0,1},..}`, iota `[G,N]<=[dims]T(perm)` or mesh-axes
`mesh['a'=2,'b'=4] {'b'}` lists) and how often it runs: a while loop's body (the scan over layers,
gradient accumulation, the pipeline schedule) runs `known_trip_count` times (from its backend
config; else the loop bound found in its condition), multiplied through nested loops.

Bytes each device sends per execution, with the standard ring algorithms on a group of n:

    all-reduce          2 (n - 1) / n x operand bytes
    all-gather          (n - 1) / n x result bytes (the gathered array: n x operand)
    reduce-scatter      (n - 1) / n x operand bytes (the full array)
    all-to-all          (n - 1) / n x operand bytes
    ragged-all-to-all   (n - 1) / n x the send buffer (routing-dependent; uniform routing)
    collective-permute  operand bytes

The time model (`estimate`) puts each collective on the slowest link its groups cross: a group
inside one node uses the node's link (NVLink), a group spanning nodes the network (InfiniBand)
(device d sits in node d // node_size: the mesh's innermost axes are the node's devices). Compute
time = FLOPs / peak. Communication fraction without overlap = comm / (comm + compute); with
perfect overlap the exposed part is max(0, comm - compute) of a max(comm, compute) step.
"""

from __future__ import annotations

import dataclasses
import glob
import math
import os
import re
import tempfile
from collections.abc import Iterable

import numpy as np

KINDS = tuple("all-reduce all-gather reduce-scatter all-to-all collective-permute ragged-all-to-all".split())
_SIZES = {
    0.5: "s4 u4 f4e2m1fn",
    1: "pred s8 u8 f8e4m3fn f8e5m2 f8e4m3 f8e4m3fnuz f8e5m2fnuz f8e3m4 f8e8m0fnu",
    2: "s16 u16 f16 bf16",
    4: "s32 u32 f32",
    8: "s64 u64 f64 c64",
    16: "c128",
    0: "token",
}
ITEMSIZE = {name: size for size, names in _SIZES.items() for name in names.split()}

KERNEL_SOURCES = "kernels_pallas/"  # files whose code runs inside pallas_call kernels
_INSTRUCTION = re.compile(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_ARRAY = re.compile(r"(\w+)\[([^\]]*)\]")
_HEADER = re.compile(r"\s*(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_CALLED = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"(?:branch|called)_computations=\{([^}]*)\}")


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    shape: str  # the result type as printed: "f32[8,32]{1,0}" or a tuple "(s32[], f32[8]{0})"
    opcode: str
    operands: tuple[str, ...]
    operand_shapes: tuple[str, ...]  # as printed inline ("f32[4]{0} %x"), else "" (look the name up)
    attributes: str  # everything after the operand list


@dataclasses.dataclass(frozen=True)
class Module:
    computations: dict[str, list[Instruction]]
    entry: str
    num_partitions: int


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of the per-device program."""

    kind: str  # one of KINDS
    name: str  # the HLO instruction
    dtype: str  # of its first operand
    operand_bytes: float  # all operands, per device
    result_bytes: float
    groups: tuple[tuple[int, ...], ...]  # device groups (source/target pairs for a permute)
    count: int  # executions per step (loop trip counts multiplied)
    op_name: str = ""  # the JAX operation it came from (metadata), for attribution
    source: tuple[str, ...] = ()  # "file:line" of its Python stack, innermost first

    @property
    def in_interpreted_kernel(self) -> bool:
        """Inside a Pallas kernel's body: on CPU the kernel runs as an HLO loop (interpret mode)
        that XLA partitions like any program; a GPU/TPU pallas_call is one opaque custom call."""
        return any(KERNEL_SOURCES in frame for frame in self.source)

    @property
    def group_size(self) -> int:
        return 2 if self.kind == "collective-permute" else max(len(g) for g in self.groups)

    @property
    def bytes_moved(self) -> float:
        """Bytes one device sends per execution (ring formulas, module docstring)."""
        n = self.group_size
        if self.kind == "collective-permute":
            return self.operand_bytes
        if self.kind == "all-reduce":
            return 2 * (n - 1) / n * self.operand_bytes
        if self.kind == "all-gather":
            return (n - 1) * self.operand_bytes
        return (n - 1) / n * self.operand_bytes

    @property
    def total_bytes(self) -> float:
        return self.bytes_moved * self.count


# --- parsing -----------------------------------------------------------------------------------


def array_bytes(shape: str) -> float:
    """Bytes of an HLO type string: an array "bf16[4,8]{1,0}" or a tuple of them."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(shape):
        if dtype in ITEMSIZE:
            total += ITEMSIZE[dtype] * math.prod(int(d.lstrip("<=")) for d in dims.split(",") if d)
    return total


def _close(text: str, start: int) -> int:
    """Index of the parenthesis closing the one opened at text[start]."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i
    return len(text)


def _split_type(text: str) -> tuple[str, str]:
    """'(f32[2], s32[]) while(...)...' -> ('(f32[2], s32[])', 'while(...)...')."""
    if not text.startswith("("):
        shape, _, rest = text.partition(" ")
        return shape, rest
    end = _close(text, 0)
    return text[: end + 1], text[end + 1 :].lstrip()


def _split_call(text: str) -> tuple[str, str, str]:
    """'all-reduce(%a, %b), channel_id=1, ...' -> ('all-reduce', '%a, %b', 'channel_id=1, ...')."""
    start = text.find("(")
    if start < 0:
        return text.strip(), "", ""
    end = _close(text, start)
    return text[:start].strip(), text[start + 1 : end], text[end + 1 :]


def parse_module(hlo_text: str) -> Module:
    """The computations of an HLO module's text, each a list of its instructions."""
    computations: dict[str, list[Instruction]] = {}
    entry, current = "", None
    partitions = re.search(r"num_partitions=(\d+)", hlo_text)
    for line in hlo_text.splitlines():
        if current is None:
            header = _HEADER.match(line)
            if header and "=" not in line.split("(", 1)[0]:
                current = computations.setdefault(header.group(1), [])
                if line.lstrip().startswith("ENTRY"):
                    entry = header.group(1)
            continue
        if line.strip() == "}":
            current = None
            continue
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        shape, rest = _split_type(match.group(2))
        opcode, operands, attributes = _split_call(rest)
        found = re.findall(r"((?:\w+\[[^\]]*\](?:\{[^}]*\})?\s+)?)%([\w.\-]+)", operands)
        names = tuple(name for _, name in found) or tuple(  # a constant's literal
            token.split()[-1] for token in operands.split(",") if token.strip() and "[" not in token
        )
        inline = tuple(printed.strip() for printed, _ in found) or ("",) * len(names)
        current.append(Instruction(match.group(1), shape, opcode, names, inline, attributes))
    return Module(computations, entry, int(partitions.group(1)) if partitions else 1)


def _trip_count(instruction: Instruction, module: Module) -> int:
    """A while loop's iterations: known_trip_count from its backend config, else the largest
    integer constant of its condition (a scan compares its counter with the length), else 1."""
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', instruction.attributes)
    if known:
        return int(known.group(1))
    condition = re.search(r"condition=%?([\w.\-]+)", instruction.attributes)
    bounds = []
    for inner in module.computations.get(condition.group(1) if condition else "", []):
        value = inner.operands[0] if inner.operands else ""
        if (
            inner.opcode == "constant"
            and re.fullmatch(r"[su](8|16|32|64)\[\]", inner.shape)
            and value.isdigit()
        ):
            bounds.append(int(value))
    return max(bounds, default=1)


def execution_counts(module: Module) -> dict[str, int]:
    """How many times each computation runs per execution of the entry computation. A loop body
    runs trip-count times its loop; conditional branches are counted as if each ran (an upper
    bound); reducers (to_apply) inherit their caller's count."""
    calls: dict[str, list[tuple[str, int]]] = {}
    for name, instructions in module.computations.items():
        edges = calls.setdefault(name, [])
        for instruction in instructions:
            times = _trip_count(instruction, module) if instruction.opcode == "while" else 1
            for called in _CALLED.findall(instruction.attributes):
                edges.append((called, times))
            for group in _BRANCHES.findall(instruction.attributes):
                edges.extend((b.strip().lstrip("%"), 1) for b in group.split(",") if b.strip())
    counts = dict.fromkeys(module.computations, 0)
    order, seen = [], set()

    def visit(name):  # callees after callers: reverse post-order of the call graph (a DAG)
        if name in seen or name not in calls:
            return
        seen.add(name)
        for callee, _ in calls[name]:
            visit(callee)
        order.append(name)

    visit(module.entry)
    counts[module.entry] = 1
    for name in reversed(order):
        for callee, times in calls[name]:
            if callee in counts:
                counts[callee] += counts[name] * times
    return counts


def _groups(attributes: str, num_partitions: int) -> tuple[tuple[int, ...], ...]:
    """Replica groups in any of the three printed forms; empty = all partitions."""
    pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", attributes)
    if pairs:
        return tuple(tuple(int(v) for v in p.split(",")) for p in re.findall(r"\{?(\d+,\d+)", pairs.group(1)))
    mesh = re.search(
        r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\((\[[\d,]+\](?:T\([\d,]+\))?|[^)]*)\))?"
        r"\s*\{([^}]*)\}",
        attributes,
    )
    if mesh:
        return _mesh_axes_groups(mesh.group(1), mesh.group(2), mesh.group(3))
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attributes)
    if iota:
        count, size = int(iota.group(1)), int(iota.group(2))
        dims = [int(d) for d in iota.group(3).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if iota.group(4):
            ids = ids.transpose([int(p) for p in iota.group(4).split(",")])
        return tuple(tuple(int(v) for v in row) for row in ids.reshape(count, size))
    explicit = re.search(r"replica_groups=\{((?:\s*\{[\d,\s]*\},?)*)\s*\}", attributes)
    if explicit and explicit.group(1).strip():
        return tuple(
            tuple(int(v) for v in g.split(",") if v.strip())
            for g in re.findall(r"\{([\d,\s]*)\}", explicit.group(1))
        )
    return (tuple(range(num_partitions)),)


def _mesh_axes_groups(axes_text: str, device_ids: str | None, selected: str) -> tuple[tuple[int, ...], ...]:
    """mesh['a'=2,'b'=4] {'b'} (or a sub-axis 'a':(pre)size): devices that differ only along the
    selected (sub-)axes form a group."""
    names, sizes = [], []
    for item in axes_text.split(","):
        name, _, size = item.partition("=")
        names.append(name.strip().strip("'\""))
        sizes.append(int(size))
    ids = np.arange(math.prod(sizes))
    iota = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", device_ids or "")
    if iota:  # an iota device order: reshape, transpose, flatten
        ids = ids.reshape([int(d) for d in iota.group(1).split(",")])
        ids = ids.transpose([int(p) for p in iota.group(2).split(",")]) if iota.group(2) else ids
    elif device_ids:
        ids = np.array([int(v) for v in re.findall(r"\d+", device_ids)])
    ids = ids.reshape(sizes)
    chosen = []  # (axis index, pre, size)
    for item in filter(None, (s.strip() for s in selected.split(","))):
        match = re.fullmatch(r"['\"]?([^'\":]+)['\"]?(?::\((\d+)\)(\d+))?", item)
        axis = names.index(match.group(1))
        pre, size = (int(match.group(2)), int(match.group(3))) if match.group(2) else (1, sizes[axis])
        chosen.append((axis, pre, size))
    # Split every axis at its selected sub-axes' boundaries, then move the selected pieces last.
    pieces_per_axis = []
    for axis, total in enumerate(sizes):
        cuts = {1, total}
        for a, pre, size in chosen:
            if a == axis:
                cuts.update((pre, pre * size))
        cuts = sorted(cuts)
        pieces_per_axis.append([(low, high // low) for low, high in zip(cuts, cuts[1:], strict=False)])
    shape, where = [], {}
    for axis, pieces in enumerate(pieces_per_axis):
        for low, size in pieces:
            where[(axis, low)] = len(shape)
            shape.append(size)
    ids = ids.reshape(shape)
    group_dims = [where[(axis, pre)] for axis, pre, _ in chosen]
    other = [d for d in range(len(shape)) if d not in group_dims]
    size = math.prod(shape[d] for d in group_dims)
    rows = ids.transpose(other + group_dims).reshape(-1, size)
    return tuple(tuple(int(v) for v in row) for row in rows)


def _stack_frames(hlo_text: str) -> dict[str, tuple[str, ...]]:
    """stack_frame_id -> ("file:line", ...) innermost first, from the module's frame tables."""
    sections = dict.fromkeys(("FileNames", "FunctionNames", "FileLocations", "StackFrames"), "")
    current = None
    for line in hlo_text.splitlines():
        if line in sections:
            current = line
        elif current and re.match(r"\d+ ", line):
            sections[current] += line + "\n"
        else:
            current = None
    files = dict(re.findall(r'^(\d+) "(.*)"$', sections["FileNames"], re.M))
    locations = {
        i: f"{files.get(f, '?')}:{n}"
        for i, f, n in re.findall(
            r"^(\d+) \{file_name_id=(\d+) function_name_id=\d+ line=(\d+)", sections["FileLocations"], re.M
        )
    }
    parents = {
        i: (loc, parent)
        for i, loc, parent in re.findall(
            r"^(\d+) \{file_location_id=(\d+) parent_frame_id=(\d+)", sections["StackFrames"], re.M
        )
    }
    stacks = {}
    for start in parents:
        chain, seen, frame = [], set(), start
        while frame in parents and frame not in seen:
            seen.add(frame)
            location, frame = parents[frame]
            chain.append(locations.get(location, "?"))
        stacks[start] = tuple(chain)
    return stacks


def parse_collectives(hlo_text: str) -> list[Collective]:
    """Every collective of a compiled HLO module with its bytes, groups and executions per step."""
    module = parse_module(hlo_text)
    counts = execution_counts(module)
    stacks = _stack_frames(hlo_text)
    found = []
    for computation, instructions in module.computations.items():
        if not counts.get(computation):
            continue
        shapes = {i.name: i.shape for i in instructions}
        for instruction in instructions:
            kind = instruction.opcode.removesuffix("-start")
            if kind not in KINDS:
                continue
            operands = [
                printed or shapes.get(name, "")
                for name, printed in zip(instruction.operands, instruction.operand_shapes, strict=True)
            ]
            if kind == "ragged-all-to-all":
                operands = operands[:1]  # the send buffer (the rest: output buffer, offsets, sizes)
            operand_bytes = sum(array_bytes(s) for s in operands) or array_bytes(instruction.shape)
            dtype = _ARRAY.match(operands[0] if operands and operands[0] else instruction.shape.lstrip("("))
            op_name = re.search(r'op_name="([^"]*)"', instruction.attributes)
            frame = re.search(r"stack_frame_id=(\d+)", instruction.attributes)
            found.append(
                Collective(
                    kind=kind,
                    name=instruction.name,
                    dtype=dtype.group(1) if dtype else "",
                    operand_bytes=operand_bytes,
                    result_bytes=array_bytes(instruction.shape),
                    groups=_groups(instruction.attributes, module.num_partitions),
                    count=counts[computation],
                    op_name=op_name.group(1) if op_name else "",
                    source=stacks.get(frame.group(1), ()) if frame else (),
                )
            )
    return found


def bytes_by_kind(found: Iterable[Collective]) -> dict[str, float]:
    """Bytes one device sends per step, per collective kind (KINDS order, all present)."""
    totals = dict.fromkeys(KINDS, 0.0)
    for collective in found:
        totals[collective.kind] += collective.total_bytes
    return totals


def dot_flops(hlo_text: str) -> float:
    """FLOPs of the dot instructions of one device's program per step, loop trip counts included
    (XLA's cost_analysis counts a loop body once): 2 x result elements x contracted size."""
    module = parse_module(hlo_text)
    counts = execution_counts(module)
    total = 0.0
    for computation, instructions in module.computations.items():
        if not counts.get(computation):
            continue
        shapes = {i.name: i.shape for i in instructions}
        for instruction in instructions:
            if instruction.opcode != "dot":
                continue
            lhs = _ARRAY.match(instruction.operand_shapes[0] or shapes.get(instruction.operands[0], ""))
            result = _ARRAY.match(instruction.shape)
            contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instruction.attributes)
            if not (lhs and result):
                continue
            lhs_dims = [int(d) for d in lhs.group(2).split(",") if d]
            contracted = (
                math.prod(lhs_dims[int(d)] for d in contracting.group(1).split(",") if d)
                if contracting
                else 1
            )
            elements = math.prod(int(d) for d in result.group(2).split(",") if d)
            total += 2.0 * elements * contracted * counts[computation]
    return total


def compile_partitioned(lowered):
    """Compiles a jax `Lowered` and returns (compiled, the HLO text right after SPMD partitioning).

    The partitioned module is the per-device program before backend passes: XLA:CPU promotes
    bf16 all-reduces and all-gathers to f32 later (all-reduce-promotion, float normalization),
    which a GPU or TPU compile does not, so the compiled CPU text would misstate their bytes. Falls
    back to the compiled text when no partitioning ran (one device)."""
    with tempfile.TemporaryDirectory(prefix="glm5-spmd-") as folder:
        compiled = lowered.compile(
            compiler_options={"xla_dump_to": folder, "xla_dump_hlo_pass_re": "spmd-partitioning"}
        )
        dumps = sorted(glob.glob(os.path.join(folder, "*after_spmd-partitioning*.txt")))
        if not dumps:
            return compiled, compiled.as_text()
        with open(dumps[-1]) as file:
            return compiled, file.read()


# --- time model --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Link:
    name: str
    bytes_per_second: float  # per device, per direction


@dataclasses.dataclass(frozen=True)
class System:
    name: str
    peak_flops: float  # per device, bf16 dense
    node_size: int  # devices joined by `local`
    local: Link
    remote: Link  # between nodes


SYSTEMS = {
    "h200": System(
        "H200 SXM, 8 per node, 989 TFLOP/s bf16 dense",
        989e12,
        8,
        Link("NVLink 4 (450 GB/s per direction)", 450e9),
        Link("InfiniBand (400 Gb/s per GPU)", 50e9),
    ),
    # 1200 GB/s bidirectional ICI per chip over 6 links: 100 GB/s per link and direction; a ring on
    # one torus axis uses 2 links (both directions). A v5p slice is all ICI (up to 6144 chips).
    "v5p": System(
        "TPU v5p, 459 TFLOP/s bf16",
        459e12,
        8960,
        Link("ICI (one torus axis: 2 x 100 GB/s per direction)", 200e9),
        Link("ICI", 200e9),
    ),
}


def link_of(collective: Collective, system: System) -> Link:
    """The slowest link a collective's groups use: remote when any group spans nodes."""
    spans = any(len({device // system.node_size for device in group}) > 1 for group in collective.groups)
    return system.remote if spans else system.local


@dataclasses.dataclass(frozen=True)
class Estimate:
    comm_seconds: float
    compute_seconds: float
    bytes_by_link: dict[str, float]

    @property
    def fraction_no_overlap(self) -> float:
        """comm / (comm + compute): the share of a step that runs them one after the other."""
        return self.comm_seconds / (self.comm_seconds + self.compute_seconds)

    @property
    def fraction_perfect_overlap(self) -> float:
        """Exposed communication / step time when communication hides behind compute."""
        step = max(self.comm_seconds, self.compute_seconds)
        return max(0.0, self.comm_seconds - self.compute_seconds) / step if step else 0.0


def counted(found: Iterable[Collective]) -> list[Collective]:
    """The collectives a GPU/TPU program would run: those inside interpreted kernels left out."""
    return [c for c in found if not c.in_interpreted_kernel]


def estimate(
    found: Iterable[Collective], flops_per_device: float, system: System, efficiency: float = 1.0
) -> Estimate:
    """Communication vs compute time of one step on `system` (compute at efficiency x peak)."""
    seconds, by_link = 0.0, {}
    for collective in counted(found):
        link = link_of(collective, system)
        seconds += collective.total_bytes / link.bytes_per_second
        by_link[link.name] = by_link.get(link.name, 0.0) + collective.total_bytes
    return Estimate(seconds, flops_per_device / (system.peak_flops * efficiency), by_link)
