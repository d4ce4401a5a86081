"""The training run behind train.py: `setup_run` reads the config, builds the mesh, data, state and
steps (restoring the latest checkpoint); `train_loop` steps, evaluates, logs and checkpoints until
the run ends or SIGTERM / SIGINT asks it to stop. train.py keeps the command line."""

from __future__ import annotations

import contextlib
import json
import math
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from tqdm import tqdm

from glm5_jax import data as data_lib
from glm5_jax.data.chat import ChatStatistics
from glm5_jax.data.schedule import schedule_from_config
from glm5_jax.data.tokenizer import tokenizer_cache_path
from glm5_jax.model import ConfigError, ModelConfig, init_params
from glm5_jax.model.config import mesh_requirements
from glm5_jax.model.count import count_params
from glm5_jax.model.options import ExecutionOptions
from glm5_jax.parallel import sharding as sharding_lib
from glm5_jax.parallel.distributed import any_process, barrier, is_primary
from glm5_jax.parallel.mesh import MeshError, MeshSpec, make_mesh
from glm5_jax.programs import StoredFunction
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


@dataclass
class Run:
    """Everything `train_loop` needs, built once by `setup_run`."""

    settings: TrainSettings
    data_config: Any  # config.data (seq_len for the tokens per step)
    run_config: dict  # saved with every checkpoint
    workdir: Path
    checkpoints: RunCheckpoints
    state: Any  # TrainState, restored or freshly initialised
    resume_step: int | None
    train_batches: Any
    validation_batches: Any
    data_schedule: Any  # None: fixed mixture weights
    chat_statistics: dict
    pairs: bool  # DPO: preference pairs
    data_kind: str
    train_step: StoredFunction
    eval_step: Callable
    place_batch: Callable  # host batch -> (sharded) device arrays
    with_reference: Callable  # DPO: adds the frozen reference's log-probs
    schedule: Callable  # step -> learning rate
    metrics_log: MetricsLog


class StopRequested:
    """Turns SIGTERM / SIGINT into a flag the loop checks between steps. In a multi-process run
    the processes agree on it after every step (`agreed`): a signal that reaches one process, or
    reaches them during different steps, stops them all after the same step."""

    def __init__(self):
        self.signal_name = None
        self.stopping = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        del frame
        if self.signal_name is not None:  # second Ctrl-C: stop now
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signum).name

    def agreed(self) -> bool:
        """Whether any process has been asked to stop (the same answer in every process)."""
        self.stopping = self.stopping or any_process(self.signal_name is not None)
        return self.stopping


def prepare_workdir(path: str) -> Path:
    """Creates the run directory and checks it is writable. Every process of a multi-process run
    probes it (a shared directory, or one per host) under its own file name."""
    workdir = Path(path)
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        probe = workdir / f".write-test.{jax.process_index()}"
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

def setup_run(config: ml_collections.ConfigDict, workdir_path: str) -> Run:
    """Reads and checks the config, prepares the workdir, data, model state and steps; a bad config
    or missing input exits with an error message."""
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
        # Several processes always need one (default: data=-1, every device of every process).
        mesh = None
        if "mesh" in config or jax.process_count() > 1:
            mesh = make_mesh(MeshSpec.from_dict(config.get("mesh")), mesh_requirements(model_config))
            rules = sharding_lib.make_rules(config.get("sharding_rules"))
            spec = (*sharding_lib.batch_sharding(mesh, rules).spec, None, None)[:2]  # rows, positions
            splits = [math.prod(mesh.shape[name] for name in
                                ((axes,) if isinstance(axes, str) else axes or ())) for axes in spec]
            if settings.batch_size % splits[0] or config.data.seq_len % splits[1]:
                raise ValueError(f"batch_size={settings.batch_size} and data.seq_len={config.data.seq_len} "
                                 f"must divide over the mesh: rows {splits[0]} ways, positions {splits[1]}")
    except (ConfigError, MeshError, ValueError) as error:
        raise SystemExit(f"error: bad config: {error}") from None
    except (RunNotFoundError, FileNotFoundError) as error:
        raise SystemExit(f"error: {error}") from None
    workdir = prepare_workdir(workdir_path)
    run_config = config.to_dict()
    primary = is_primary()  # process 0 writes the run's files; the others read them
    if primary:
        (workdir / "run_config.json").write_text(json.dumps(run_config, indent=2))

    # ---------------------------------------------------------------- tokenizer and data
    try:
        if settings.init_from:  # the checkpoint's own tokenizer
            tokenizer = init_from_lib.load_tokenizer(settings.init_from)
        else:
            cache_dir = str(Path(config.data.cache_dir or workdir).expanduser())
            trains = not config.data.tokenizer_path and not tokenizer_cache_path(
                sources, config.data.vocab_size, cache_dir).is_file()
            if not primary:  # process 0 trains and caches it; the others load the cache
                barrier("glm5_jax_tokenizer")
            with Phase(f"training a byte-level BPE tokenizer (vocab {config.data.vocab_size}) on the "
                       f"sources, cached in {cache_dir}", "trained the tokenizer"
                       ) if trains else contextlib.nullcontext():
                tokenizer = data_lib.load_or_train_tokenizer(
                    config.data.tokenizer_path or None, sources, config.data.vocab_size, cache_dir)
            if primary:
                barrier("glm5_jax_tokenizer")
        data_lib.check_vocab_fits(tokenizer, model_config.vocab_size)
    except (FileNotFoundError, ValueError) as error:
        raise SystemExit(f"error: {error}") from None
    if primary:
        tokenizer.save(str(workdir / "tokenizer.json"))
        if settings.init_from:
            init_from_lib.copy_chat_files(settings.init_from, workdir)
    barrier("glm5_jax_run_files")  # the chat template is read below
    data_options = dict(seq_len=config.data.seq_len, seed=config.data.seed,
                        validation_fraction=config.data.validation_fraction)
    chat_statistics = {}
    if any(spec.kind in ("chat_jsonl", "preference_jsonl") for spec in sources):  # the run's chat template
        data_options["chat_renderer"] = chat_renderer(workdir)
        chat_statistics = {"train": ChatStatistics(), "validation": ChatStatistics()}
    # batch_size is global, and so is the order: every process reads the same global batches (the
    # same iterator state, saved once) and places only its devices' rows (place_batch below), so
    # any number of processes trains on the same data and a run resumes on another process count.
    with Phase(f"reading and tokenizing the data ({len(sources)} source{'s' * (len(sources) > 1)})",
               "read the data"):
        train_batches = data_lib.make_train_iterator(
            sources, tokenizer, batch_size=settings.batch_size,
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
    # What the run's jitted closures (init, train and evaluation steps) capture, for the keys of
    # their stored programs: the settings make the optimizer and its schedule.
    captured = (model_config, settings, options, None if mesh is None else rules)
    if resume_step is not None:
        loading = Phase(f"restoring checkpoint step {resume_step}", f"restored step {resume_step}")
    elif settings.init_from:
        loading = Phase(f"loading the weights of {settings.init_from}", "loaded the weights")
    else:
        loading = Phase("initialising the parameters (XLA compiles or loads the initialisation first)",
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
        # On a mesh each shard is initialised where it lives (a large model never exists on one
        # device). The program is stored: a restart loads it (glm5_jax/programs.py).
        shardings = None if mesh is None else train_state_shardings(model_config, optimizer, mesh, rules,
                                                                    options=options)
        state = StoredFunction("init_train_state", jax.jit(make_state, out_shardings=shardings),
                               captured, mesh=mesh)()
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
    on_mesh = None if mesh is None else (lambda: sharding_lib.activate(mesh, rules))
    if mesh is None:
        train_step = StoredFunction("train_step", make_train_step(model_config, settings, optimizer,
                                                                  options=options), captured)
        place_batch = lambda batch: batch  # noqa: E731
    else:
        train_step = StoredFunction("train_step", make_train_step(
            model_config, settings, optimizer, mesh, rules, options=options).jitted, captured, mesh=mesh,
            context=on_mesh)
        batch_sharding = sharding_lib.batch_sharding(mesh, rules)
        place_batch = lambda batch: {  # noqa: E731  the global batch -> this process's devices' slices
            key: jax.make_array_from_callback(np.shape(value), batch_sharding,
                                              lambda index, value=value: np.asarray(value[index]))
            for key, value in batch.items()}
        print("mesh: " + ", ".join(f"{name}={size}" for name, size in mesh.shape.items()), flush=True)
    eval_step = StoredFunction("eval_step", make_eval_step(model_config, token_bytes, options),
                               (*captured, token_bytes), mesh=mesh)
    if settings.objective == "dpo":  # the reference: the init_from weights, frozen (a copy: steps donate)
        reference_params = init_from_lib.initial_weights(
            settings.init_from, model_config, options,
            None if mesh is None else lambda *_, **__: train_state_shardings(
                model_config, optimizer, mesh, rules, options=options).params)
        reference_log_probs = StoredFunction("reference_log_probs", make_reference_log_probs(
            model_config, options), captured, mesh=mesh)
        with_reference = lambda batch: {  # noqa: E731
            **batch, "reference_log_probs": reference_log_probs(reference_params, batch)}
        with Phase("scoring the validation pairs with the reference (XLA compiles or loads its forward "
                   "first)",
                   "scored the validation pairs"):
            validation_batches = [with_reference(place_batch(batch)) for batch in validation_batches]
        eval_step = StoredFunction("dpo_eval_step", make_dpo_eval_step(model_config, settings.dpo_beta,
                                                                       options), captured, mesh=mesh)
    else:
        with_reference = lambda batch: batch  # noqa: E731
    schedule = learning_rate_schedule(settings)
    metrics_log = MetricsLog(workdir, resume_step, writer=primary)
    return Run(settings=settings, data_config=config.data, run_config=run_config, workdir=workdir,
        checkpoints=checkpoints, state=state, resume_step=resume_step, train_batches=train_batches,
        validation_batches=validation_batches, data_schedule=data_schedule,
        chat_statistics=chat_statistics, pairs=pairs, data_kind=data_kind, train_step=train_step,
        eval_step=eval_step, place_batch=place_batch, with_reference=with_reference,
        schedule=schedule, metrics_log=metrics_log)


def train_loop(run: Run) -> None:
    """Trains until num_train_steps or a stop signal, then saves and closes the run."""
    (settings, data_config, run_config, workdir, checkpoints, state, resume_step, train_batches,
     validation_batches, data_schedule, chat_statistics, pairs, data_kind, train_step, eval_step,
     place_batch, with_reference, schedule, metrics_log) = (
        run.settings, run.data_config, run.run_config, run.workdir, run.checkpoints, run.state,
        run.resume_step, run.train_batches, run.validation_batches, run.data_schedule,
        run.chat_statistics, run.pairs, run.data_kind, run.train_step, run.eval_step,
        run.place_batch, run.with_reference, run.schedule, run.metrics_log)
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
        evaluating = Phase("step 0: evaluating (XLA compiles or loads the evaluation step first)",
                           "step 0: evaluated")
        evaluation = evaluate(eval_step, state.params, validation_batches)
        evaluating.done(show(evaluation))
        metrics_log.write(0, evaluation)
        first_evaluation = False
    tokens_per_step = settings.batch_size * data_config.seq_len
    bad_steps = 0
    last_saved = resume_step
    progress = tqdm(total=settings.num_train_steps, initial=step, unit="step", dynamic_ncols=True,
                    mininterval=1.0, file=sys.stdout)
    while step < settings.num_train_steps and not stop.agreed():
        if data_schedule is not None and data_schedule.stage_starts(step):
            # Logged under the stage's first step, so a resume at the boundary rewrites it exactly once.
            stage = data_schedule.stage_at(step)
            metrics_log.write(step + 1, data_schedule.describe(stage))
            tqdm.write(f"data stage {stage} from step {step + 1}: " + ", ".join(
                f"{key.removeprefix('data/')} {value:.3g}" for key, value in
                data_schedule.describe(stage).items() if key != "data/stage"))
        compiling = Phase(f"step {step + 1}: compiling the train step (the first step compiles or loads "
                          "it, then runs)",
                          f"step {step + 1}: compiled and ran", tqdm.write) if first_step else None
        started = time.perf_counter()
        batch = with_reference(place_batch(next(train_batches)))
        state, metrics = train_step(state, batch)
        step += 1
        loss = float(metrics["loss"])  # waits for the step: the timing below is honest
        seconds = time.perf_counter() - started
        if compiling is not None:
            if train_step.loaded:  # (a StoredFunction) its program came from the store
                compiling.finished = f"step {step}: loaded the stored program and ran"
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
            stacks = [np.asarray(value, np.float64) for key, value in metrics.items()
                      if key.startswith("expert_load/") and key != "expert_load/mtp"]
            load = np.concatenate(stacks) if stacks else np.zeros((1, 1))  # [MoE layers, E]
            record.update(learning_rate=schedule(step - 1), tokens_per_second=tokens_per_step / seconds,
                          step_seconds=seconds,
                          expert_load_max_over_mean=float(load.max() / max(load.mean(), 1e-9)),
                          expert_load=load.astype(int).tolist())
            metrics_log.write(step, record)
        if step % settings.eval_every == 0 or step == settings.num_train_steps:
            evaluating = Phase(f"step {step}: evaluating (XLA compiles or loads the evaluation step first)",
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
    if stop.stopping and last_saved != step:
        checkpoints.save(step, state, train_batches.get_state(), run_config)
    checkpoints.close()
    metrics_log.close()
    if stop.stopping:
        print(f"{stop.signal_name or 'a stop signal to another process'}: saved checkpoint at step "
              f"{step} in {workdir}; run the same command to resume.")
    else:
        print(f"done: {step} steps; checkpoints in {checkpoints.directory}")
