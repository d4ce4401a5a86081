"""Reference vs Pallas kernel, per benchmark case of every kernels_pallas module that defines
`benchmark_cases()`: median wall time of each (jit, warm-up, block_until_ready), their ratio,
and the kernel's TFLOP/s and GB/s (with the fraction of the H200 peak when on a GPU).

    PYTHONPATH=. python bench/kernels.py --check            (on the GPU/TPU: real GLM-5 shapes)
    PYTHONPATH=. python bench/kernels.py --small --check    (CPU smoke test: tiny shapes, interpreter)

--check also compares the kernel's outputs with the reference's at the case's atol/rtol (through
the case's compare_as, when it has one), prints PASS/FAIL and exits non-zero on any FAIL. A case
that raises is reported as ERROR (exit non-zero).

Time limits: each function of a case stops timing once --case-seconds have passed (at least one
warm-up and one timed run; the row then says how many runs its median has), and no case starts
after --budget-s (its row says "skipped"), so the table is complete inside a fixed step limit.
Rows print as soon as they are measured.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without PYTHONPATH

import jax  # noqa: E402
import numpy as np  # noqa: E402

from kernels_pallas.common import PEAKS  # noqa: E402

# Kernel modules in the order they are reported; missing ones are skipped with a note.
MODULES = ("flash_attention", "sparse_attention", "dsa_indexer", "mla_decode", "ragged_paged_attention",
           "moe_grouped_matmul", "fp8_matmul", "kda")


# ----------------------------------------------------------------------------- cases
def load_cases(small: bool, only: str | None):
    """[(module name, KernelCase)] whose name contains `only`, and notes on skipped modules."""
    cases, notes = [], []
    for name in MODULES:
        try:
            module = importlib.import_module(f"kernels_pallas.{name}")
        except ModuleNotFoundError as error:
            notes.append(f"{name}: skipped, module not found ({error})")
            continue
        if not hasattr(module, "benchmark_cases"):
            notes.append(f"{name}: skipped, no benchmark_cases()")
            continue
        try:
            module_cases = module.benchmark_cases(small=small)
        except TypeError:  # an older signature without `small`
            module_cases = module.benchmark_cases()
            if small:
                notes.append(f"{name}: benchmark_cases() takes no `small`; ran its full-size cases")
        cases += [(name, case) for case in module_cases if only is None or only in f"{name} {case.name}"]
    return cases, notes


# ----------------------------------------------------------------------------- measuring
def measure(fn, inputs, warmup: int, iters: int, seconds: float):
    """Median milliseconds of fn(*inputs) over up to `iters` timed runs after up to `warmup` untimed
    ones (the first compiles); fewer of both once `seconds` have passed, but at least one of each.
    Returns (median ms, timed runs, the last output)."""
    start = time.perf_counter()
    out = None
    for _ in range(max(warmup, 1)):
        out = jax.block_until_ready(fn(*inputs))
        if time.perf_counter() - start > seconds / 2:
            break
    times = []
    while len(times) < iters:
        begin = time.perf_counter()
        out = jax.block_until_ready(fn(*inputs))
        times.append(time.perf_counter() - begin)
        if time.perf_counter() - start + times[-1] > seconds:  # the next run would pass the cap
            break
    return 1e3 * statistics.median(times), len(times), out


def compare(expected, got, atol: float, rtol: float) -> tuple[bool, float]:
    """(all leaves allclose, largest |difference|), leaves compared in float32."""
    expected_leaves, expected_tree = jax.tree.flatten(expected)
    got_leaves, got_tree = jax.tree.flatten(got)
    if expected_tree != got_tree:
        return False, float("inf")
    ok, worst = True, 0.0
    for e, g in zip(expected_leaves, got_leaves, strict=True):
        e, g = np.asarray(e, np.float32), np.asarray(g, np.float32)
        if e.shape != g.shape:
            return False, float("inf")
        if e.size:
            with np.errstate(invalid="ignore"):  # inf - inf (equal infinities) is nan, ignored
                worst = max(worst, float(np.nan_to_num(np.nanmax(np.abs(e - g)), nan=0.0)))
        ok &= bool(np.allclose(g, e, atol=atol, rtol=rtol))
    return ok, worst


def _timing(ms: float, runs: int, iters: int) -> str:
    return f"{ms:.3f}" if runs >= iters else f"{ms:.3f} ({runs} runs)"


def run_case(case, args, on_gpu: bool) -> dict:
    """Times reference and kernel (and compares them with --check). Returns the table cells."""
    row = {"name": case.name, "ref": "-", "pallas": "-", "ratio": "-", "tflops": "-", "gbs": "-",
           "peak": "-", "check": "-", "status": "ok"}
    inputs = jax.block_until_ready(case.make_inputs(jax.random.key(args.seed)))
    reference, kernel = jax.jit(case.reference), jax.jit(case.kernel)
    ref_ms = kernel_ms = None
    try:
        ref_ms, runs, expected = measure(reference, inputs, args.warmup, args.iters, args.case_seconds)
        row["ref"] = _timing(ref_ms, runs, args.iters)
    except Exception as error:  # noqa: BLE001 - e.g. a cuDNN reference on a machine without cuDNN
        row["ref"] = f"error: {type(error).__name__}"
        row["status"] = "error"
        if args.verbose:
            traceback.print_exc()
    try:
        kernel_ms, runs, got = measure(kernel, inputs, args.warmup, args.iters, args.case_seconds)
    except Exception as error:  # noqa: BLE001
        first_line = (str(error).splitlines() or [""])[0][:80]
        row["pallas"] = f"error: {type(error).__name__}: {first_line}"
        row["status"] = "error"
        if args.verbose:
            traceback.print_exc()
        return row
    seconds = kernel_ms * 1e-3
    tflops, gbs = case.flops / seconds / 1e12, case.bytes_moved / seconds / 1e9
    row.update(pallas=_timing(kernel_ms, runs, args.iters), tflops=f"{tflops:.3g}", gbs=f"{gbs:.3g}")
    if ref_ms is not None:
        row["ratio"] = f"{ref_ms / kernel_ms:.2f}x"
    if on_gpu:
        peak = PEAKS["H200"]
        row["peak"] = f"{tflops / peak['bf16_tflops']:.0%} / {gbs / peak['hbm_gbs']:.0%}"
    if args.check and ref_ms is not None:
        try:
            if case.compare_as is not None:
                as_compared = jax.jit(case.compare_as)
                expected, got = as_compared(inputs, expected), as_compared(inputs, got)
            ok, worst = compare(expected, got, case.atol, case.rtol)
        except Exception as error:  # noqa: BLE001
            row["check"] = f"error: {type(error).__name__}"
            row["status"] = "error"
            return row
        verdict = "PASS" if ok else "FAIL"
        row["check"] = f"{verdict} (max err {worst:.1e}, atol {case.atol:g}, rtol {case.rtol:g})"
        if not ok:
            row["status"] = "fail"
    return row


# ----------------------------------------------------------------------------- main
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="compare kernel outputs with the reference (PASS/FAIL; exit 1 on FAIL)")
    parser.add_argument("--only", default=None, help="run only cases whose name contains this substring")
    parser.add_argument("--small", action="store_true",
                        help="tiny shapes (benchmark_cases(small=True)): a CPU smoke test in the interpreter")
    parser.add_argument("--iters", type=int, default=None,
                        help="timed runs per case (default 20; 2 with --small)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs first (the first one compiles)")
    parser.add_argument("--case-seconds", type=float, default=30.0,
                        help="per function of a case: no more warm-up after half of this, no timed run "
                             "that would end after it (at least one of each)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no case after this many seconds; the rest are listed as skipped")
    parser.add_argument("--seed", type=int, default=0, help="random key of the case inputs")
    parser.add_argument("--verbose", action="store_true", help="print tracebacks of failing cases")
    args = parser.parse_args(argv)
    if args.iters is None:
        args.iters = 2 if args.small else 20
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # each row reaches a tee'd log as it is printed
    started = time.perf_counter()
    on_gpu = jax.default_backend() == "gpu"
    device = jax.devices()[0]
    print(f"device: {device.platform} {getattr(device, 'device_kind', '')}; jax {jax.__version__}; "
          f"{'small' if args.small else 'full'} shapes; median of {args.iters} after {args.warmup} warm-up\n")

    cases, notes = load_cases(args.small, args.only)
    header = ["kernel", "shapes", "reference ms", "pallas ms", "ratio (ref/pallas)", "TFLOP/s", "GB/s",
              "H200 peak (flops / bw)"] + (["check"] if args.check else [])
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    rows = []
    for module, case in cases:
        if args.budget_s is not None and time.perf_counter() - started > args.budget_s:
            row = {"name": case.name, "ref": "-", "pallas": f"skipped (over --budget-s {args.budget_s:g})",
                   "ratio": "-", "tflops": "-", "gbs": "-", "peak": "-", "check": "-", "status": "skipped"}
        else:
            row = run_case(case, args, on_gpu)
        rows.append(row)
        cells = [module, row["name"], row["ref"], row["pallas"], row["ratio"], row["tflops"], row["gbs"],
                 row["peak"]] + ([row["check"]] if args.check else [])
        print("| " + " | ".join(cells) + " |", flush=True)

    for note in notes:
        print(f"\nnote: {note}")
    errors = sum(row["status"] == "error" for row in rows)
    failures = sum(row["status"] == "fail" for row in rows)
    skipped = sum(row["status"] == "skipped" for row in rows)
    print(f"\n{len(rows)} cases, {failures} FAIL, {errors} ERROR, {skipped} skipped "
          f"({time.perf_counter() - started:.0f} s)")
    return 1 if errors or failures or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
