#!/usr/bin/env bash
# GPU check of the Pallas kernels on one NVIDIA H200, in under 8 minutes:
#   1. environment (python, jax, devices; stops early only if jax cannot import)
#   2. the kernel test files compiled for the GPU (Triton), forward and gradients vs references
#   3. python bench/kernels.py --check: every kernel's benchmark cases vs their jnp reference, with
#      time, TFLOP/s or GB/s and the fraction of H200 peak; each case is time-capped and no case
#      starts after the step's own budget, so the table ends inside the step's limit (a built-in
#      fallback runs the same cases only if bench/kernels.py is missing or dies before printing
#      its table, e.g. on import; never after a timeout, which it would only repeat)
#   4. a short training run with the Pallas kernels, then MTP speculative decoding through
#      serve.py on that run (bench/speculative.py, N = 0 vs 3)
# Step limits (seconds) within the default 460 s budget: environment 60, tests 110 (about 55 on
# the H200), kernel bench 150, training 90, speculative bench the rest (at least ~100, at most 300).
# Test workers share the GPU, so they allocate on demand (no 75% preallocation each).
# Each step has a hard timeout and the whole script a budget; a failing step does not stop the
# others; a summary comes last.
#
# Usage (repository root, no network needed):  PYTHONPATH=. bash bench/gpu_check.sh
# Environment: GPU_CHECK_BUDGET_S (default 460), GPU_CHECK_LOGS (default $OUT or /tmp),
# GPU_CHECK_SMALL=1 (a dry run of this script on a CPU: tiny benchmark shapes, and only the
# kernel tests that lower for Triton/Mosaic, since the interpreted suite takes minutes there).

set -u
cd "$(dirname "$0")/.." || exit 1
export PYTHONPATH="$(pwd)${PYTHONPATH:+:${PYTHONPATH}}"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cuda}"  # tests/conftest.py would otherwise pick the CPU
BUDGET_S="${GPU_CHECK_BUDGET_S:-460}"
LOGS="${GPU_CHECK_LOGS:-${OUT:-/tmp}}/gpu_check_logs"
mkdir -p "$LOGS"
PY="${PYTHON:-python}"
declare -a SUMMARY=()
CURRENT_STEP=""  # process group of the running step, ended if this script is interrupted
trap '[[ -n "$CURRENT_STEP" ]] && kill -KILL -- "-$CURRENT_STEP" 2>/dev/null; exit 130' INT TERM

# run_step NAME LIMIT_S COMMAND: runs COMMAND under `timeout` (capped by the budget left),
# prints and logs its output, ends what the step left running, records PASS / FAIL / TIMEOUT / SKIP.
run_step() {
  local name="$1" limit="$2" cmd="$3"
  local left=$((BUDGET_S - SECONDS))
  (( limit > left )) && limit=$left
  echo
  echo "=================== ${name} (limit ${limit}s, ${SECONDS}s elapsed) ==================="
  if (( limit < 15 )); then
    SUMMARY+=("SKIP     ${name} (out of time budget)")
    return 0
  fi
  local start=$SECONDS log="$LOGS/$(echo "$name" | tr -c 'A-Za-z0-9' '_').log"
  # The step writes to its log; tail shows it as it comes. timeout runs it in a process group of
  # its own (id = timeout's pid). On a timeout, timeout's KILL only follows its direct child: a
  # process that handled the TERM and lives on (train.py saves a checkpoint; a server) would keep
  # the GPU busy, or a pipe open, during the next steps. So what is left of the group is ended.
  : > "$log"  # exists before tail opens it
  timeout --kill-after=10 "$limit" bash -c "$cmd" >> "$log" 2>&1 &
  CURRENT_STEP=$!
  tail -n +1 -f --pid="$CURRENT_STEP" "$log" &
  local tail_pid=$!
  wait "$CURRENT_STEP"
  local rc=$?
  kill -KILL -- "-$CURRENT_STEP" 2>/dev/null
  CURRENT_STEP=""
  wait "$tail_pid"
  local took=$((SECONDS - start)) status="PASS"
  if (( rc == 124 || rc == 137 )); then status="TIMEOUT"; elif (( rc != 0 )); then status="FAIL(rc=$rc)"; fi
  SUMMARY+=("$(printf '%-8s %s (%ss)' "$status" "$name" "$took")")
  return "$rc"
}

# ------------------------------------------------------------------------------ 1. environment
run_step "environment" 60 "
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c 'import sys, jax; print(\"python\", sys.version.split()[0], \"jax\", jax.__version__); \
print(\"devices\", jax.devices()); print(\"default backend\", jax.default_backend())'
" || { echo "jax does not import or sees no device: stopping"; printf '%s\n' "${SUMMARY[@]}"; exit 1; }
if ! $PY -c 'import jax, sys; sys.exit(jax.default_backend() != "gpu")' 2>/dev/null; then
  echo "WARNING: jax's default backend is not the GPU; kernels will run in interpret mode"
fi

# ------------------------------------------------------------------------------ 2. kernel tests
SELECT=""; [[ "${GPU_CHECK_SMALL:-0}" == 1 ]] && SELECT="-k lower"
if $PY -c 'import pytest' 2>/dev/null; then
  run_step "kernel tests compiled on GPU" 110 \
    "XLA_PYTHON_CLIENT_PREALLOCATE=false $PY -m pytest -q -n 4 --maxfail=5 -p no:cacheprovider tests/kernels/test_kernels_*.py $SELECT --durations=5"
else
  SUMMARY+=("SKIP     kernel tests (pytest is not installed)")
fi

# ------------------------------------------------------------------------------ 3. kernel benchmarks
FALLBACK_BENCH=$(cat <<'PYEOF'
"""Fallback for bench/kernels.py --check: every kernels_pallas module's benchmark_cases()."""
import importlib, os, pkgutil, time, traceback
import jax, numpy as np
import kernels_pallas
from kernels_pallas.common import PEAKS
peak = PEAKS["H200"]
for info in sorted(pkgutil.iter_modules(kernels_pallas.__path__), key=lambda m: m.name):
    module = importlib.import_module(f"kernels_pallas.{info.name}")
    if not hasattr(module, "benchmark_cases"):
        continue
    for case in module.benchmark_cases(small=os.environ.get("GPU_CHECK_SMALL") == "1"):
        try:
            inputs = case.make_inputs(jax.random.PRNGKey(0))
            kernel, reference = jax.jit(case.kernel), jax.jit(case.reference)
            got, want = jax.block_until_ready(kernel(*inputs)), jax.block_until_ready(reference(*inputs))
            if getattr(case, "compare_as", None) is not None:  # e.g. a top-k selection -> its scores
                got, want = case.compare_as(inputs, got), case.compare_as(inputs, want)
            ok = all(np.allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), atol=case.atol,
                                 rtol=case.rtol) for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
            def timed(fn, reps=10, seconds=10.0):  # mean of up to reps runs, fewer past `seconds`
                jax.block_until_ready(fn(*inputs))
                start, runs = time.perf_counter(), 0
                while runs < reps and (runs == 0 or time.perf_counter() - start < seconds):
                    jax.block_until_ready(fn(*inputs))
                    runs += 1
                return (time.perf_counter() - start) / runs
            t_kernel, t_ref = timed(kernel), timed(reference)
            tflops, gbs = case.flops / t_kernel / 1e12, case.bytes_moved / t_kernel / 1e9
            print(f"{'OK ' if ok else 'BAD'} {case.name}: {t_kernel * 1e3:.3f} ms (reference {t_ref * 1e3:.3f} ms, "
                  f"x{t_ref / t_kernel:.2f}) {tflops:.1f} TFLOP/s ({tflops / peak['bf16_tflops']:.1%} of peak) "
                  f"{gbs:.0f} GB/s ({gbs / peak['hbm_gbs']:.1%} of peak)", flush=True)
        except Exception:  # one broken case must not hide the others
            print(f"ERR {case.name}\n{traceback.format_exc(limit=3)}", flush=True)
PYEOF
)
export FALLBACK_BENCH
RUN_FALLBACK=0
BENCH_NAME="bench/kernels.py --check"
if [[ -f bench/kernels.py ]]; then
  SMALL_FLAG=""; [[ "${GPU_CHECK_SMALL:-0}" == 1 ]] && SMALL_FLAG="--small"
  # 150 s step: no case starts after 110 s, and one case spends at most ~2 x 15 s timing plus its
  # check, so the table completes inside the limit.
  run_step "$BENCH_NAME" 150 \
    "$PY bench/kernels.py --check --iters 10 --case-seconds 15 --budget-s 110 $SMALL_FLAG"
  rc=$?
  # Timeout (124/137): the fallback would repeat the same slow cases. rc 1 with the table header
  # in the log: some case FAILed or raised, and its row says so. Only a run that died before its
  # table (import error, crash at start) falls back.
  BENCH_LOG="$LOGS/$(echo "$BENCH_NAME" | tr -c 'A-Za-z0-9' '_').log"
  if (( rc != 0 && rc != 124 && rc != 137 )) && ! grep -q '^| kernel |' "$BENCH_LOG" 2>/dev/null; then
    RUN_FALLBACK=1
  fi
else
  SUMMARY+=("SKIP     bench/kernels.py (file not present)")
  RUN_FALLBACK=1
fi
if (( RUN_FALLBACK == 1 )); then
  run_step "kernel cases (built-in fallback)" 150 "$PY -c \"\$FALLBACK_BENCH\"" || true
fi

# ------------------------------------------------------------------------------ 4. smoke timings
TRAIN_DIR="$(mktemp -d)"
# The demo config with the Pallas attention (a config file: the CLI only overrides existing fields).
# A CPU dry run interprets Pallas (over 80 s per step there), so it trains 2 steps on the reference
# attention: it checks the plumbing (config, checkpoint, serve.py), not the kernels.
TRAIN_IMPL=pallas; TRAIN_STEPS=30
[[ "${GPU_CHECK_SMALL:-0}" == 1 ]] && { TRAIN_IMPL=reference; TRAIN_STEPS=2; }
cat > "$TRAIN_DIR/demo_$TRAIN_IMPL.py" <<PYEOF
from glm5_jax.config_files import load_config_file


def get_config():
    config = load_config_file("$(pwd)/configs/demo.py")
    config.execution.attention_impl = "$TRAIN_IMPL"
    config.num_train_steps = $TRAIN_STEPS
    config.eval_every = 1000
    config.checkpoint_every = 1000
    return config
PYEOF
run_step "train.py $TRAIN_STEPS steps, attention_impl=$TRAIN_IMPL" 90 \
  "set -o pipefail; $PY train.py --config $TRAIN_DIR/demo_$TRAIN_IMPL.py --workdir $TRAIN_DIR/run 2>&1 | tail -15"
TRAIN_RC=$?
# MTP speculative decoding through serve.py on that run (its MTP layer barely trained in 30 steps,
# so acceptance is low; the tok/s ratio at N=0 vs N=3 is the GPU figure the CPU cannot give). Only
# after a finished run: a timed-out one leaves no complete checkpoint to serve.
# It takes the rest of the budget: each N starts serve.py (143 s of load + warm-up on a CPU), so
# the CPU dry run starts it once (N = 3 only).
SPEC_TOKENS="0 3"; [[ "${GPU_CHECK_SMALL:-0}" == 1 ]] && SPEC_TOKENS="3"
if (( TRAIN_RC == 0 )); then
  run_step "bench/speculative.py (N $SPEC_TOKENS, 1 and 8 clients)" 300 \
    "$PY bench/speculative.py --checkpoint $TRAIN_DIR/run --tokens $SPEC_TOKENS --rounds 1 --max-tokens 32" || true
else
  SUMMARY+=("SKIP     bench/speculative.py (the training step did not finish)")
fi

# ------------------------------------------------------------------------------ summary
echo
echo "=================== summary (${SECONDS}s of ${BUDGET_S}s budget; logs in ${LOGS}) ==================="
printf '%s\n' "${SUMMARY[@]}"
