"""Time to the first train step of train.py: a cold start (empty compilation cache) and warm starts
(the same cache), measured from process start to the line that says step 1 ran.

    python bench/train_restart.py [--config configs/demo.py] [--starts 2] [--cache-dir DIR] [-- FLAGS...]

Each start runs `train.py --config CONFIG --workdir <fresh> --compilation_cache_dir DIR
--config.num_train_steps=1 FLAGS...` and reports the seconds until each phase line appears
(parameters initialised, step 0 evaluated, step 1 ran), whether step 1's program was compiled or
loaded from the program store (`programs/` in the cache directory, glm5_jax/programs.py), the
process's whole run time, and the entries of the cache and the store afterwards. Every start
trains from scratch in a fresh run directory (a resume restores a checkpoint first, which costs
the same with or without stored programs). The load average is printed with the figures.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from glm5_jax.compile_cache import cache_entries, stored_programs  # noqa: E402 - no JAX: plain os

# Phase name -> what its line holds (train.py's Phase messages, glm5_jax/train/loop.py).
PHASES = {"initialised": ("initialised the parameters in ",), "evaluated": ("step 0: evaluated in ",),
          "step 1": ("step 1: ", " ran in ")}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/demo.py", help="train.py's --config")
    parser.add_argument("--starts", type=int, default=2, help="starts on one cache: 1 cold, the rest warm")
    parser.add_argument("--cache-dir", help="compilation cache directory (default: a fresh temporary one)")
    parser.add_argument("train_flags", nargs="*", help="more train.py flags (after --)")
    return parser.parse_args(argv)


def one_start(args, cache_dir: str, workdir: Path) -> dict:
    command = [sys.executable, "train.py", f"--config={args.config}", f"--workdir={workdir}",
               f"--compilation_cache_dir={cache_dir}", "--config.num_train_steps=1", *args.train_flags]
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, bufsize=1)
    seen, lines = {}, []
    for raw in process.stdout:
        for line in raw.replace("\r", "\n").splitlines():
            lines.append(line)
            for name, parts in PHASES.items():
                if name not in seen and all(part in line for part in parts):
                    seen[name] = time.perf_counter() - started
    process.wait()
    if process.returncode != 0:
        raise SystemExit("train.py failed:\n" + "\n".join(lines[-30:]))
    step_line = next(line for line in lines if "step 1: " in line and " ran in " in line)
    return {**seen, "exit": time.perf_counter() - started,
            "step 1 program": "loaded" if "loaded the stored program" in step_line else "compiled"}


def main(argv=None) -> None:
    args = parse_args(argv)
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="glm5-train-restart-")
    print(f"train.py --config {args.config} {' '.join(args.train_flags)}; cache {cache_dir}", flush=True)
    for start in range(args.starts):
        with tempfile.TemporaryDirectory(prefix="glm5-train-restart-run-") as workdir:
            load = os.getloadavg()[0]
            result = one_start(args, cache_dir, Path(workdir))
        kind = "cold" if start == 0 and not args.cache_dir else "warm"
        phases = ", ".join(f"{name} {result[name]:.1f} s" for name in PHASES if name in result)
        print(f"start {start + 1} ({kind}): {phases}; exit {result['exit']:.1f} s; step 1's program "
              f"{result['step 1 program']}; cache {cache_entries(cache_dir)} entries, program store "
              f"{stored_programs(cache_dir)}; load average {load:.1f}", flush=True)


if __name__ == "__main__":
    main()
