#!/usr/bin/env bash
# GPU check of the Pallas kernels on one NVIDIA H200, in under 8 minutes:
#   1. environment (python, jax, devices; stops early only if jax cannot import)
#   2. the kernel test files compiled for the GPU (Triton), forward and gradients vs references
#   3. python bench/kernels.py --check: every kernel's benchmark cases vs their jnp reference, with
#      time, TFLOP/s or GB/s and the fraction of H200 peak (a built-in fallback runs the same
#      cases if bench/kernels.py is missing, crashes or times out)
#   4. if time is left: a short training run with the Pallas kernels, then MTP speculative
#      decoding through serve.py on that run (bench/speculative.py, N = 0 vs 3)
# Each step has a hard timeout and the whole script a budget; a failing step does not stop the
# others; a summary comes last.
#
# Usage (repository root, no network needed):  PYTHONPATH=. bash bench/gpu_check.sh
# Environment: GPU_CHECK_BUDGET_S (default 460), GPU_CHECK_LOGS (default $OUT or /tmp),
# GPU_CHECK_SMALL=1 (tiny benchmark shapes: a dry run of this script on a CPU).

set -u
cd "$(dirname "$0")/.." || exit 1
export PYTHONPATH="$(pwd)${PYTHONPATH:+:${PYTHONPATH}}"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cuda}"  # tests/conftest.py would otherwise pick the CPU
BUDGET_S="${GPU_CHECK_BUDGET_S:-460}"
LOGS="${GPU_CHECK_LOGS:-${OUT:-/tmp}}/gpu_check_logs"
mkdir -p "$LOGS"
PY="${PYTHON:-python}"
declare -a SUMMARY=()

# run_step NAME LIMIT_S COMMAND: runs COMMAND under `timeout` (capped by the budget left),
# prints and logs its output, records PASS / FAIL / TIMEOUT / SKIP.
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
  timeout --kill-after=10 "$limit" bash -c "$cmd" 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
  local took=$((SECONDS - start)) status="PASS"
  if (( rc == 124 || rc == 137 )); then status="TIMEOUT"; elif (( rc != 0 )); then status="FAIL(rc=$rc)"; fi
  SUMMARY+=("$(printf '%-8s %s (%ss)' "$status" "$name" "$took")")
  return "$rc"
}

# ------------------------------------------------------------------------------ 1. environment
run_step "environment" 90 "
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c 'import sys, jax; print(\"python\", sys.version.split()[0], \"jax\", jax.__version__); \
print(\"devices\", jax.devices()); print(\"default backend\", jax.default_backend())'
" || { echo "jax does not import or sees no device: stopping"; printf '%s\n' "${SUMMARY[@]}"; exit 1; }
if ! $PY -c 'import jax, sys; sys.exit(jax.default_backend() != "gpu")' 2>/dev/null; then
  echo "WARNING: jax's default backend is not the GPU; kernels will run in interpret mode"
fi

# ------------------------------------------------------------------------------ 2. kernel tests
if $PY -c 'import pytest' 2>/dev/null; then
  run_step "kernel tests compiled on GPU" 150 \
    "$PY -m pytest -q --maxfail=5 -p no:cacheprovider tests/test_kernels_*.py --durations=5"
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
            ok = all(np.allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), atol=case.atol,
                                 rtol=case.rtol) for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
            def timed(fn, reps=10):
                jax.block_until_ready(fn(*inputs))
                start = time.perf_counter()
                for _ in range(reps):
                    out = fn(*inputs)
                jax.block_until_ready(out)
                return (time.perf_counter() - start) / reps
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
KERNELS_OK=0
if [[ -f bench/kernels.py ]]; then
  SMALL_FLAG=""; [[ "${GPU_CHECK_SMALL:-0}" == 1 ]] && SMALL_FLAG="--small"
  run_step "bench/kernels.py --check" 210 "$PY bench/kernels.py --check --iters 10 $SMALL_FLAG"
  # rc 1 = some case FAILed or raised: its table is printed, so the fallback would only repeat it.
  (( $? <= 1 )) && KERNELS_OK=1
else
  SUMMARY+=("SKIP     bench/kernels.py (file not present)")
fi
if (( KERNELS_OK == 0 )); then
  run_step "kernel cases (built-in fallback)" 200 "$PY -c \"\$FALLBACK_BENCH\"" || true
fi

# ------------------------------------------------------------------------------ 4. smoke timings
TRAIN_DIR="$(mktemp -d)"
# The demo config with the Pallas attention (a config file: the CLI only overrides existing fields).
cat > "$TRAIN_DIR/demo_pallas.py" <<PYEOF
from glm5_jax.config_files import load_config_file


def get_config():
    config = load_config_file("$(pwd)/configs/demo.py")
    config.execution.attention_impl = "pallas"
    config.num_train_steps = 30
    config.eval_every = 1000
    config.checkpoint_every = 1000
    return config
PYEOF
run_step "train.py 30 steps, attention_impl=pallas" 100 \
  "set -o pipefail; $PY train.py --config $TRAIN_DIR/demo_pallas.py --workdir $TRAIN_DIR/run 2>&1 | tail -15" || true
# MTP speculative decoding through serve.py on that run (its MTP layer barely trained in 30 steps,
# so acceptance is low; the tok/s ratio at N=0 vs N=3 is the GPU figure the CPU cannot give).
if [[ -d "$TRAIN_DIR/run/checkpoints" ]]; then
  run_step "bench/speculative.py (N 0 3, 1 and 8 clients)" 150 \
    "$PY bench/speculative.py --checkpoint $TRAIN_DIR/run --tokens 0 3 --rounds 1 --max-tokens 32" || true
else
  SUMMARY+=("SKIP     bench/speculative.py (the training step produced no run)")
fi

# ------------------------------------------------------------------------------ summary
echo
echo "=================== summary (${SECONDS}s of ${BUDGET_S}s budget; logs in ${LOGS}) ==================="
printf '%s\n' "${SUMMARY[@]}"
