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
  objective    "lm" (next-token loss) or "dpo" (preference_jsonl pairs against the frozen init_from
               weights; dpo_beta)
  dsa_stage    "off", "dense_warmup" (dense attention, only the indexer trains on its KL to the
               attention) or "sparse" (top-k attention + the indexer KL); indexer_kl_weight
  fine-tuning  init_from (an HF checkpoint or train.py run directory: its architecture, weights
               and tokenizer; config.model may be omitted, fields it gives must agree; the
               directory must stay readable while the run resumes), trainable / frozen
               (fnmatch patterns on parameter paths, e.g. ("*/attention/*",))
The workdir (default runs/<config name>) receives checkpoints/, metrics.jsonl, tokenizer.json
and run_config.json. Re-running the same command resumes from the latest checkpoint.
SIGTERM or Ctrl-C saves a checkpoint and exits; SIGKILL never corrupts the latest checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags
from tqdm import tqdm

from glm5_jax import data as data_lib
from glm5_jax.data.chat import ChatStatistics
from glm5_jax.data.schedule import schedule_from_config
from glm5_jax.data.tokenizer import tokenizer_cache_path
from glm5_jax.host_memory import reuse_freed_memory
from glm5_jax.model import ConfigError, ModelConfig, init_params
from glm5_jax.model.config import mesh_requirements
from glm5_jax.model.count import count_params
from glm5_jax.model.options import ExecutionOptions
from glm5_jax.parallel import sharding as sharding_lib
from glm5_jax.parallel.mesh import MeshError, MeshSpec, initialize_distributed, make_mesh
from glm5_jax.train import init_from as init_from_lib
from glm5_jax.train.checkpoints import CheckpointError, RunCheckpoints
from glm5_jax.train.dpo import make_dpo_eval_step, make_reference_log_probs
from glm5_jax.train.metrics import MetricsLog
from glm5_jax.train.optimizer import learning_rate_schedule, make_optimizer, trained_names
from glm5_jax.train.runs import RunNotFoundError
from glm5_jax.train.settings import TrainSettings
from glm5_jax.train.step import (
    init_train_state,
    make_eval_step,
    make_train_step,
    train_state_shardings,
)

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/demo.py", "Training config file (a Python file with get_config()).")
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Run directory for checkpoints and metrics (default: runs/<config name>).")
_REUSE_HOST_MEMORY = flags.DEFINE_bool(
    "reuse_host_memory", True, "Keep freed host memory for reuse (glibc malloc: one heap, never "
    "trimmed), so a CPU step's temporaries do not page-fault in again each step (moe16 train step "
    "-25%); the process keeps its peak memory (glm5_jax/host_memory.py).")


class StopRequested:
    """Turns SIGTERM / SIGINT into a flag the loop checks between steps."""

    def __init__(self):
        self.signal_name = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        del frame
        if self.signal_name is not None:  # second Ctrl-C: stop now
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signum).name


def prepare_workdir(path: str) -> Path:
    workdir = Path(path)
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        probe = workdir / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as error:
        raise SystemExit(f"error: run directory {workdir} is not writable ({error})") from None
    return workdir


class Phase:
    """Says what a phase that can take a while is doing ("<doing>..."), then, at `done()` or the
    end of a `with` block, how long it took ("<finished> in 12.3 s"): a run never sits silent for
    minutes (tokenizer training, reading data, loading weights, XLA compiling the steps).
    write: tqdm.write once the progress bar is up."""

    def __init__(self, doing: str, finished: str, write=print):
        self.finished, self.write = finished, write
        self.write(f"{doing}...")
        sys.stdout.flush()
        self.started = time.perf_counter()

    def done(self, result: str = "") -> None:
        seconds = time.perf_counter() - self.started
        self.write(f"{self.finished} in {seconds:.1f} s" + (f"; {result}" if result else ""))
        sys.stdout.flush()

    def __enter__(self):
        return self

    def __exit__(self, error_type, *_):
        if error_type is None:
            self.done()


def evaluate(eval_step, params, batches) -> dict[str, float]:
    totals = {"nats": 0.0, "tokens": 0.0, "bytes": 0.0}
    for batch in batches:
        for key, value in eval_step(params, batch).items():
            totals[key] = totals.get(key, 0.0) + float(value)
    if "pairs" in totals:  # DPO: held-out pairs' loss, reward margin and accuracy
        pairs = max(totals["pairs"], 1.0)
        return {"val_dpo_loss": totals["nats"] / pairs, "val_reward_margin": totals["margin"] / pairs,
                "val_reward_accuracy": totals["correct"] / pairs}
    loss = totals["nats"] / max(totals["tokens"], 1.0)
    return {"val_loss": loss, "val_bpb": totals["nats"] / (math.log(2) * max(totals["bytes"], 1.0))}


def chat_renderer(workdir: Path):
    """The run's chat template (copied from init_from's checkpoint), else the built-in GLM-5 format."""
    from glm5_jax.chat.template import ChatRenderer, load_chat_template, load_special_tokens

    return ChatRenderer(load_chat_template(workdir), load_special_tokens(workdir))


def main(argv):
    del argv
    if _REUSE_HOST_MEMORY.value:  # before JAX starts its CPU threads
        reuse_freed_memory()
    logging.set_verbosity(logging.WARNING)  # orbax reports every file it writes at INFO
    initialize_distributed()  # multi-host: JAX's runtime from the cluster environment; else no-op
    # ---------------------------------------------------------------- config
    config = _CONFIG.value
    config_name = Path(config_flags.get_config_filename(flags.FLAGS["config"])).stem
    try:
        settings = TrainSettings.from_config(config)
        if settings.init_from:  # the architecture is the checkpoint's; the run records all of it
            model_config = init_from_lib.merge_architecture(
                config.get("model"), init_from_lib.checkpoint_architecture(settings.init_from))
            with config.unlocked():
                config.model = ml_collections.ConfigDict(model_config.to_dict())
        else:
            model_config = ModelConfig.from_dict(config.model)
        options = ExecutionOptions.from_dict(config.get("execution"))
        sources = [data_lib.source_spec_from_dict(dict(s)) for s in config.data.sources]
        if (settings.objective == "dpo") != all(spec.kind == "preference_jsonl" for spec in sources):
            raise ValueError(f"objective={settings.objective!r} needs "
                             + ("only preference_jsonl sources" if settings.objective == "dpo"
                                else "text or chat sources "
                                     "(preference_jsonl pairs train with objective='dpo')"))
        data_schedule = schedule_from_config(config.data.get("schedule"), sources)  # None: fixed weights
        # config.mesh (optional): axis sizes; config.sharding_rules: logical axis overrides.
        mesh = None
        if "mesh" in config:
            mesh = make_mesh(MeshSpec.from_dict(config.mesh), mesh_requirements(model_config))
            rules = sharding_lib.make_rules(config.get("sharding_rules"))
            if settings.batch_size % jax.process_count():
                raise ValueError(f"batch_size={settings.batch_size} must divide over "
                                 f"{jax.process_count()} hosts")
    except (ConfigError, MeshError, ValueError) as error:
        raise SystemExit(f"error: bad config: {error}") from None
    except (RunNotFoundError, FileNotFoundError) as error:
        raise SystemExit(f"error: {error}") from None
    workdir = prepare_workdir(_WORKDIR.value or f"runs/{config_name}")
    run_config = config.to_dict()
    (workdir / "run_config.json").write_text(json.dumps(run_config, indent=2))

    # ---------------------------------------------------------------- tokenizer and data
    try:
        if settings.init_from:  # the checkpoint's own tokenizer
            tokenizer = init_from_lib.load_tokenizer(settings.init_from)
        else:
            cache_dir = str(Path(config.data.cache_dir or workdir).expanduser())
            trains = not config.data.tokenizer_path and not tokenizer_cache_path(
                sources, config.data.vocab_size, cache_dir).is_file()
            with Phase(f"training a byte-level BPE tokenizer (vocab {config.data.vocab_size}) on the "
                       f"sources, cached in {cache_dir}", "trained the tokenizer"
                       ) if trains else contextlib.nullcontext():
                tokenizer = data_lib.load_or_train_tokenizer(
                    config.data.tokenizer_path or None, sources, config.data.vocab_size, cache_dir)
        data_lib.check_vocab_fits(tokenizer, model_config.vocab_size)
    except (FileNotFoundError, ValueError) as error:
        raise SystemExit(f"error: {error}") from None
    tokenizer.save(str(workdir / "tokenizer.json"))
    if settings.init_from:
        init_from_lib.copy_chat_files(settings.init_from, workdir)
    data_options = dict(seq_len=config.data.seq_len, seed=config.data.seed,
                        validation_fraction=config.data.validation_fraction)
    chat_statistics = {}
    if any(spec.kind in ("chat_jsonl", "preference_jsonl") for spec in sources):  # the run's chat template
        data_options["chat_renderer"] = chat_renderer(workdir)
        chat_statistics = {"train": ChatStatistics(), "validation": ChatStatistics()}
    # batch_size is global; each host loads its own rows from its own shard of the documents.
    with Phase(f"reading and tokenizing the data ({len(sources)} source{'s' * (len(sources) > 1)})",
               "read the data"):
        train_batches = data_lib.make_train_iterator(
            sources, tokenizer, batch_size=settings.batch_size // jax.process_count(),
            shard_index=jax.process_index(), shard_count=jax.process_count(),
            chat_statistics=chat_statistics.get("train"), schedule=data_schedule, **data_options)
        validation_batches = data_lib.make_validation_batches(
            sources, tokenizer, batch_size=settings.batch_size, max_batches=settings.eval_batches,
            chat_statistics=chat_statistics.get("validation"), **data_options)
    pairs = settings.objective == "dpo"  # preference pairs, counted as pairs and answers
    data_kind = "preference_data" if pairs else "chat_data"
    for split, counts in chat_statistics.items():
        summary = ", ".join(f"{k} {v}" for k, v in counts.as_dict(pairs).items())
        print(f"{data_kind.replace('_', ' ')} ({split}): " + summary, flush=True)
    token_bytes = jnp.asarray(data_lib.token_byte_lengths(tokenizer), jnp.float32)
    token_bytes = jnp.pad(token_bytes, (0, max(model_config.vocab_size - token_bytes.shape[0], 0)))

    # ---------------------------------------------------------------- model, optimizer, state
    optimizer = make_optimizer(settings)
    checkpoints = RunCheckpoints(workdir, settings.keep_checkpoints, settings.checkpoint_every)
    try:  # the newest intact step; newer damaged ones are named and moved aside to <step>.corrupt
        resume_step = checkpoints.usable_step()
    except CheckpointError as error:
        raise SystemExit(f"error: {error}") from None
    make_state = lambda: init_train_state(  # noqa: E731
        init_params(model_config, settings.seed, options=options), optimizer)
    if resume_step is not None:
        loading = Phase(f"restoring checkpoint step {resume_step}", f"restored step {resume_step}")
    elif settings.init_from:
        loading = Phase(f"loading the weights of {settings.init_from}", "loaded the weights")
    else:
        loading = Phase("initialising the parameters (XLA compiles the initialisation first)",
                        "initialised the parameters")
    if resume_step is None and settings.init_from:  # fine-tuning: the weights, a fresh optimizer
        param_shardings = None if mesh is None else train_state_shardings(
            model_config, optimizer, mesh, rules, options=options).params
        try:
            params = init_from_lib.initial_weights(
                settings.init_from, model_config, options,
                None if mesh is None else lambda *_, **__: param_shardings)
        except (ConfigError, FileNotFoundError) as error:
            raise SystemExit(f"error: {error}") from None
        state = init_train_state(params, optimizer)
        trained = trained_names(params, settings)
        print(f"initialised from {settings.init_from}; training {len(trained)} of "
              f"{len(jax.tree.leaves(params))} parameter arrays", flush=True)
    elif resume_step is None:
        if mesh is None:
            state = make_state()
        else:  # initialise each shard where it lives (a large model never exists on one device)
            state = jax.jit(make_state, out_shardings=train_state_shardings(
                model_config, optimizer, mesh, rules, options=options))()
    else:
        abstract = jax.eval_shape(make_state)
        if mesh is not None:  # restore straight into the mesh layout
            abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract,
                                    train_state_shardings(model_config, optimizer, mesh, rules,
                                                          options=options))
        try:
            state, data_state, _ = checkpoints.restore(resume_step, abstract)
            train_batches.set_state(data_state)
        except CheckpointError as error:  # e.g. the model config changed since the checkpoint
            raise SystemExit(f"error: {error}") from None
        except ValueError as error:  # e.g. data.schedule added or removed since the checkpoint
            raise SystemExit(f"error: cannot resume the data at step {resume_step}: {error}") from None
    loading.done()
    counts = count_params(model_config)
    print(f"model: {counts['total'] / 1e6:.1f}M params ({counts['active'] / 1e6:.1f}M active, "
          f"MTP {counts['mtp'] / 1e6:.1f}M); tokenizer vocab {tokenizer.get_vocab_size()}; "
          f"workdir {workdir}" + (f"; resuming at step {resume_step}" if resume_step else ""),
          flush=True)
    if mesh is None:
        train_step = make_train_step(model_config, settings, optimizer, options=options)
        place_batch = lambda batch: batch  # noqa: E731
    else:
        train_step = make_train_step(model_config, settings, optimizer, mesh, rules, options=options)
        batch_sharding = sharding_lib.batch_sharding(mesh, rules)
        place_batch = lambda batch: {  # noqa: E731
            key: jax.make_array_from_process_local_data(batch_sharding, np.asarray(value))
            for key, value in batch.items()}
        print("mesh: " + ", ".join(f"{name}={size}" for name, size in mesh.shape.items()), flush=True)
    eval_step = make_eval_step(model_config, token_bytes, options)
    if settings.objective == "dpo":  # the reference: the init_from weights, frozen (a copy: steps donate)
        reference_params = init_from_lib.initial_weights(
            settings.init_from, model_config, options,
            None if mesh is None else lambda *_, **__: train_state_shardings(
                model_config, optimizer, mesh, rules, options=options).params)
        reference_log_probs = make_reference_log_probs(model_config, options)
        with_reference = lambda batch: {  # noqa: E731
            **batch, "reference_log_probs": reference_log_probs(reference_params, batch)}
        with Phase("scoring the validation pairs with the reference (XLA compiles its forward first)",
                   "scored the validation pairs"):
            validation_batches = [with_reference(place_batch(batch)) for batch in validation_batches]
        eval_step = make_dpo_eval_step(model_config, settings.dpo_beta, options)
    else:
        with_reference = lambda batch: batch  # noqa: E731
    schedule = learning_rate_schedule(settings)
    metrics_log = MetricsLog(workdir, resume_step)

    # ---------------------------------------------------------------- loop
    stop = StopRequested()
    step = int(state.step)
    if chat_statistics:  # what chat data was kept, cut and skipped (the truncation rules)
        metrics_log.write(step, {f"{data_kind}/{split}/{name}": value
                                 for split, counts in chat_statistics.items()
                                 for name, value in counts.as_dict(pairs).items()})
    show = lambda evaluation: " ".join(f"{key} {value:.4f}" for key, value in evaluation.items())  # noqa: E731
    # The first evaluation and the first train step of a process compile their programs (tens of
    # seconds to minutes for the demo on a CPU): each says so, then how long it took.
    first_evaluation = first_step = True
    if step == 0:
        evaluating = Phase("step 0: evaluating (XLA compiles the evaluation step first)", "step 0: evaluated")
        evaluation = evaluate(eval_step, state.params, validation_batches)
        evaluating.done(show(evaluation))
        metrics_log.write(0, evaluation)
        first_evaluation = False
    tokens_per_step = settings.batch_size * config.data.seq_len
    bad_steps = 0
    last_saved = resume_step
    progress = tqdm(total=settings.num_train_steps, initial=step, unit="step", dynamic_ncols=True,
                    mininterval=1.0, file=sys.stdout)
    while step < settings.num_train_steps and stop.signal_name is None:
        if data_schedule is not None and data_schedule.stage_starts(step):
            # Logged under the stage's first step, so a resume at the boundary rewrites it exactly once.
            stage = data_schedule.stage_at(step)
            metrics_log.write(step + 1, data_schedule.describe(stage))
            tqdm.write(f"data stage {stage} from step {step + 1}: " + ", ".join(
                f"{key.removeprefix('data/')} {value:.3g}" for key, value in
                data_schedule.describe(stage).items() if key != "data/stage"))
        compiling = Phase(f"step {step + 1}: compiling the train step (the first step compiles, then runs)",
                          f"step {step + 1}: compiled and ran", tqdm.write) if first_step else None
        started = time.perf_counter()
        batch = with_reference(place_batch(next(train_batches)))
        state, metrics = train_step(state, batch)
        step += 1
        loss = float(metrics["loss"])  # waits for the step: the timing below is honest
        seconds = time.perf_counter() - started
        if compiling is not None:
            compiling.done(f"loss {loss:.4f}")
            first_step = False
        if not bool(metrics["finite"]):
            bad_steps += 1
            tqdm.write(f"step {step}: non-finite loss or gradient; update skipped "
                       f"({bad_steps}/{settings.max_bad_steps} in a row)")
            metrics_log.write(step, {"loss": loss, "skipped": True})
            if bad_steps >= settings.max_bad_steps:
                checkpoints.close()
                raise SystemExit(f"error: stopping after {bad_steps} consecutive non-finite steps "
                                 f"(step {step}); lower learning_rate or check the data/config")
            progress.update(1)
            continue
        bad_steps = 0
        progress.update(1)
        progress.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_step / seconds:,.0f}",
                             step_s=f"{seconds:.2f}")
        if step % settings.log_every == 0 or step == settings.num_train_steps:
            logged_keys = ("loss", "cross_entropy", "z_loss", "mtp_loss", "balance_loss",
                           "reward_margin", "reward_accuracy", "indexer_kl", "indexer_recall", "grad_norm")
            record = {key: metrics[key] for key in logged_keys if key in metrics}
            load = np.asarray(metrics.get("expert_load/moe_layers", np.zeros((1, 1))), np.float64)
            record.update(learning_rate=schedule(step - 1), tokens_per_second=tokens_per_step / seconds,
                          step_seconds=seconds,
                          expert_load_max_over_mean=float(load.max() / max(load.mean(), 1e-9)),
                          expert_load=load.astype(int).tolist())
            metrics_log.write(step, record)
        if step % settings.eval_every == 0 or step == settings.num_train_steps:
            evaluating = Phase(f"step {step}: evaluating (XLA compiles the evaluation step first)",
                               f"step {step}: evaluated", tqdm.write) if first_evaluation else None
            evaluation = evaluate(eval_step, state.params, validation_batches)
            metrics_log.write(step, evaluation)
            if evaluating is not None:
                evaluating.done(show(evaluation))
                first_evaluation = False
            else:
                tqdm.write(f"step {step}: " + show(evaluation))
        if checkpoints.due(step) or step == settings.num_train_steps:
            checkpoints.save(step, state, train_batches.get_state(), run_config)
            last_saved = step
    progress.close()

    # ---------------------------------------------------------------- finish
    if stop.signal_name is not None and last_saved != step:
        checkpoints.save(step, state, train_batches.get_state(), run_config)
    checkpoints.close()
    metrics_log.close()
    if stop.signal_name is not None:
        print(f"{stop.signal_name}: saved checkpoint at step {step} in {workdir}; "
              "run the same command to resume.")
    else:
        print(f"done: {step} steps; checkpoints in {checkpoints.directory}")


if __name__ == "__main__":
    app.run(main)
