"""Train a GLM-5-architecture model.

    python train.py --config configs/demo.py [--workdir runs/demo] [--config.<field>=<value> ...]

The config file's `get_config()` returns an ml_collections ConfigDict with these parts:
  model.*      the architecture (see glm5_jax/model/config.py; e.g. --config.model.num_layers=6)
  execution.*  how it runs (optional; glm5_jax/model/options.py): dtype, param_dtype, remat,
               scan_unroll, causal_block_size, moe_impl, attention_impl, indexer_impl,
               decode_attention_impl, expert_dispatch, expert_capacity_factor, pipeline_microbatches
               (e.g. --config.execution.remat=full)
  data.*       sources, each with a kind and a weight: python_stdlib | files | jsonl | chat_jsonl
               (trains on assistant turns only, rendered with the run's chat template) |
               preference_jsonl (chosen/rejected pairs for objective="dpo") | prepared (the shards
               `python -m glm5_jax.prepare` writes; glm5_jax/data/sources.py),
               tokenizer_path ("" trains a byte-level BPE of data.vocab_size on the sources, cached
               in data.cache_dir, or in the workdir when cache_dir is ""),
               seq_len, validation_fraction, seed, and optionally schedule: staged mixtures, a list of
               dict(until_step=N, weights=dict(<source name>=w, ...), difficulty_weight=b) whose last
               stage has no until_step; a stage trains the steps after the previous until_step up to
               its own, its weights replace the sources' weights, and b > 0 draws a prepared source's
               documents with probability ~ exp(b * difficulty). Deterministic; resuming mid-stage
               reproduces the uninterrupted run; each stage's weights go to metrics.jsonl (data/...) at
               its first step (glm5_jax/data/schedule.py, docs/data.md "Staged mixtures")
  top level    num_train_steps (run length), batch_size, grad_accum_steps, learning_rate,
               warmup_steps, min_learning_rate_ratio, weight_decay, adam_b1/b2/eps,
               clip_grad_norm, z_loss_weight, mtp_loss_weight, balance_loss_weight,
               router_bias_update_rate, log_every, eval_every, eval_batches, checkpoint_every,
               keep_checkpoints, max_bad_steps, seed
  objective    "lm" (next-token loss), "dpo" (preference_jsonl pairs against the frozen init_from
               weights; dpo_beta) or "grpo" (RL from verifier rewards: the serving engine samples
               grpo.group_size completions of each of config.tasks' prompts, config.rewards scores
               them; grpo.* in glm5_jax/train/grpo.py, docs/finetuning.md "GRPO")
  dsa_stage    "off", "dense_warmup" (dense attention, only the indexer trains on its KL to the
               attention) or "sparse" (top-k attention + the indexer KL); indexer_kl_weight
  fine-tuning  init_from (an HF checkpoint or train.py run directory: its architecture, weights
               and tokenizer; config.model may be omitted, fields it gives must agree; the
               directory must stay readable while the run resumes), trainable / frozen
               (fnmatch patterns on parameter paths, e.g. ("*/attention/*",))
The workdir (default runs/<config name>) receives checkpoints/, metrics.jsonl, tokenizer.json
and run_config.json. Re-running the same command resumes from the latest checkpoint.
SIGTERM or Ctrl-C saves a checkpoint and exits; SIGKILL never corrupts the latest checkpoint.
Several processes (one per host; `python -m glm5_jax.launch --processes N -- train.py ...` on one
machine) run the same command and train on the same global batches as one process would
(docs/scaling.md: the launcher and cluster recipes; docs/training.md: failure and resume).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from absl import app, flags, logging
from ml_collections import config_flags

from glm5_jax.compile_cache import CACHE_HELP, default_cache_dir, enable_compilation_cache
from glm5_jax.host_memory import reuse_freed_memory
from glm5_jax.parallel.distributed import (
    MODES,
    Timeouts,
    exit_at_once_on_error,
    initialize_distributed,
    is_primary,
)

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/demo.py", "Training config file (a Python file with get_config()).")
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Run directory for checkpoints and metrics (default: runs/<config name>).")
_REUSE_HOST_MEMORY = flags.DEFINE_bool(
    "reuse_host_memory", True, "Keep freed host memory for reuse (glibc malloc: one heap, never "
    "trimmed), so a CPU step's temporaries do not page-fault in again each step (moe16 train step "
    "-25%); the process keeps its peak memory (glm5_jax/host_memory.py).")
_COMPILATION_CACHE_DIR = flags.DEFINE_string(
    "compilation_cache_dir", None, f"{CACHE_HELP} (default: $JAX_COMPILATION_CACHE_DIR, else "
    "~/.cache/glm5_jax/xla).")
_COMPILATION_CACHE = flags.DEFINE_bool(
    "compilation_cache", True, "Use JAX's persistent compilation cache (--nocompilation_cache: compile "
    "everything, read and write no cache).")
# Multi-process runs (python -m glm5_jax.launch, or a cluster: docs/scaling.md).
_DISTRIBUTED = flags.DEFINE_enum(
    "distributed", "auto", list(MODES), "Join jax.distributed: auto (when the environment names a "
    "coordinator, JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, or is a SLURM step or "
    "Open MPI job of several tasks), on (always: JAX detects the cluster itself, e.g. a Cloud TPU "
    "pod), off (one process).")
_HEARTBEAT_TIMEOUT = flags.DEFINE_integer(
    "heartbeat_timeout", Timeouts.heartbeat, "Multi-process: seconds without a heartbeat after which "
    "a process counts as dead and every other process is ended (JAX's default is 100).")
_SHUTDOWN_TIMEOUT = flags.DEFINE_integer(
    "shutdown_timeout", Timeouts.shutdown, "Multi-process: seconds a finished process waits for the "
    "others at the end (JAX's default is 300).")
_INITIALIZATION_TIMEOUT = flags.DEFINE_integer(
    "initialization_timeout", Timeouts.initialization, "Multi-process: seconds every process has "
    "to connect to the coordinator at the start.")


def main(argv):
    del argv
    if _REUSE_HOST_MEMORY.value:  # before JAX starts its CPU threads
        reuse_freed_memory()
    # Before anything compiles: a resumed or repeated run loads its programs instead.
    enable_compilation_cache((_COMPILATION_CACHE_DIR.value or default_cache_dir())
                             if _COMPILATION_CACHE.value else None)
    logging.set_verbosity(logging.WARNING)  # orbax reports every file it writes at INFO
    # Multi-process: JAX's runtime from the launcher's or the cluster's environment; else no-op.
    distributed = initialize_distributed(Timeouts(initialization=_INITIALIZATION_TIMEOUT.value,
                                                  heartbeat=_HEARTBEAT_TIMEOUT.value,
                                                  shutdown=_SHUTDOWN_TIMEOUT.value),
                                         mode=_DISTRIBUTED.value)
    if distributed and not is_primary():  # process 0 reports the run; errors (stderr) come from all
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's prints and C++'s
    from glm5_jax.train.loop import setup_run, train_loop  # JAX loads after the malloc setting above

    config_name = Path(config_flags.get_config_filename(flags.FLAGS["config"])).stem
    workdir = _WORKDIR.value or f"runs/{config_name}"
    with exit_at_once_on_error(distributed):  # a failing process must not wait for the others
        if _CONFIG.value.get("objective") == "grpo":  # RL: the serving engine samples in this process
            from glm5_jax.rl.loop import run_grpo

            run_grpo(_CONFIG.value, workdir)
        else:
            train_loop(setup_run(_CONFIG.value, workdir))


if __name__ == "__main__":
    app.run(main)
