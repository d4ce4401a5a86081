"""`train.py` with `config.objective = "grpo"`: RL from verifier rewards, the serving engine as the
rollout worker in the same process (docs/finetuning.md, "GRPO").

One step: the engine samples `group_size` completions of each of `prompts_per_step` training
prompts (the policy's current weights, handed over after every step); the verifiers score them
(`config.rewards`); the rollouts become one packed batch with group-relative advantages
(glm5_jax/rl/batches.py); the jitted train step takes one optimizer step on the GRPO loss
(glm5_jax/train/grpo.py). With `grpo.off_policy = 1` the engine samples step n + 1's rollouts on
its thread while step n trains (the rollouts are one step stale; the importance ratio corrects
for it); 0 keeps every step on-policy. `staleness` in the log says which.

Checkpoints hold the train state (policy and optimizer) and, as the data state, the rollouts
already sampled for the next step (off-policy); prompts and sampling seeds are functions of the
step, and the reference is the init_from weights, so a resumed run repeats the uninterrupted one.
Held-out prompts (never trained on) are answered greedily at step 0, every eval_every steps and
at the end: `heldout/reward` with its 95% interval.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import sys
import time

import jax
import ml_collections
import numpy as np
from tqdm import tqdm

from glm5_jax.model import ConfigError
from glm5_jax.model.options import ExecutionOptions
from glm5_jax.model.transformer import apply_model
from glm5_jax.programs import StoredFunction
from glm5_jax.rl.batches import grpo_batch
from glm5_jax.rl.rewards import Reward, make_rewards, summary
from glm5_jax.rl.rollouts import Rollout, RolloutWorker, sample_seed
from glm5_jax.rl.tasks import load_tasks
from glm5_jax.train import init_from as init_from_lib
from glm5_jax.train.checkpoints import CheckpointError, RunCheckpoints
from glm5_jax.train.grpo import policy_log_probs
from glm5_jax.train.loop import Phase, StopRequested, chat_renderer, prepare_workdir
from glm5_jax.train.metrics import MetricsLog
from glm5_jax.train.optimizer import learning_rate_schedule, make_optimizer
from glm5_jax.train.runs import RunNotFoundError
from glm5_jax.train.settings import TrainSettings
from glm5_jax.train.step import init_train_state, make_train_step

Z_95 = 1.959963984540054


def mean_interval(values) -> tuple[float, float, float]:
    """(mean, low, high): a 95% interval of the mean (Wilson's for 0/1 rewards, else normal)."""
    values = np.asarray(values, np.float64)
    count, mean = len(values), float(values.mean())
    if np.all((values == 0) | (values == 1)):
        centre = (mean + Z_95**2 / (2 * count)) / (1 + Z_95**2 / count)
        half = Z_95 * math.sqrt(mean * (1 - mean) / count + Z_95**2 / (4 * count**2)) / (1 + Z_95**2 / count)
        return mean, centre - half, centre + half
    half = Z_95 * float(values.std(ddof=1)) / math.sqrt(count) if count > 1 else float("nan")
    return mean, mean - half, mean + half


def prompt_order(count: int, seed: int, step: int, per_step: int) -> list[int]:
    """The training prompts of optimizer step `step` (1-based): consecutive windows of a fresh
    permutation of the prompts each epoch."""
    permutations = {}  # one permutation per epoch the step's window touches (at most two)
    indices = []
    for position in range((step - 1) * per_step, step * per_step):
        epoch, offset = divmod(position, count)
        if epoch not in permutations:
            permutations[epoch] = np.random.default_rng([seed, epoch]).permutation(count)
        indices.append(int(permutations[epoch][offset]))
    return indices


def make_reference_log_probs(config, options, temperature: float):
    """reference_log_probs(params, batch) -> [B, T] f32, the frozen reference's token log-probs at
    the rollout temperature (aligned like every per-token field)."""

    @jax.jit
    def reference_log_probs(params, batch):
        logits = apply_model(config, params, batch["input_ids"], batch["positions"], batch["segment_ids"],
                             options=options)["logits"]
        return policy_log_probs(logits, batch["input_ids"], temperature)

    return reference_log_probs


def run_grpo(config: ml_collections.ConfigDict, workdir_path: str) -> None:
    """The whole GRPO run: set-up, steps, evaluation, checkpoints; a bad config exits with an error."""
    try:
        settings = TrainSettings.from_config(config)
        grpo = settings.grpo
        if jax.process_count() > 1 or "mesh" in config:
            raise ValueError("objective='grpo' runs in one process on one device for now (the rollout "
                             "engine shares the trainer's device; a mesh or several processes are not "
                             "supported yet): remove config.mesh")
        model_config = init_from_lib.merge_architecture(
            config.get("model"), init_from_lib.checkpoint_architecture(settings.init_from))
        with config.unlocked():
            config.model = ml_collections.ConfigDict(model_config.to_dict())
        options = ExecutionOptions.from_dict(config.get("execution"))
        if "tasks" not in config or "rewards" not in config:
            raise ValueError("objective='grpo' needs config.tasks (the prompts, glm5_jax/rl/tasks.py) and "
                             "config.rewards (the verifiers, glm5_jax/rl/rewards.py)")
        seq_len = (config.get("data") or {}).get("seq_len")
        if not isinstance(seq_len, int) or seq_len < 2:
            raise ValueError(f"data.seq_len must be an integer >= 2 (the packed rows' length: prompt + "
                             f"completion tokens per sequence), got {seq_len!r}")
        rewards = make_rewards([dict(spec) for spec in config.rewards])
        train_tasks, held_out = [], []
        for spec in config.tasks:
            train_part, held_part = load_tasks(dict(spec), settings.seed)
            train_tasks += train_part
            held_out += held_part
        if not train_tasks:
            raise ValueError("config.tasks gave no training prompts")
        if settings.grad_accum_steps > settings.batch_size:
            raise ValueError(f"grad_accum_steps {settings.grad_accum_steps} exceeds batch_size "
                             f"{settings.batch_size} (the least rows per step)")
    except (ConfigError, ValueError) as error:
        raise SystemExit(f"error: bad config: {error}") from None
    except (RunNotFoundError, FileNotFoundError) as error:
        raise SystemExit(f"error: {error}") from None
    workdir = prepare_workdir(workdir_path)
    run_config = config.to_dict()
    (workdir / "run_config.json").write_text(json.dumps(run_config, indent=2))
    tokenizer = init_from_lib.load_tokenizer(settings.init_from)
    tokenizer.save(str(workdir / "tokenizer.json"))
    init_from_lib.copy_chat_files(settings.init_from, workdir)
    renderer = chat_renderer(workdir)
    evaluated_tasks = held_out[:grpo.eval_prompts]
    print(f"tasks: {len(train_tasks)} training prompts, {len(held_out)} held out "
          f"({len(evaluated_tasks)} evaluated); rewards: {', '.join(rewards.names)}", flush=True)

    # ---------------------------------------------------------------- state
    optimizer = make_optimizer(settings)
    checkpoints = RunCheckpoints(workdir, settings.keep_checkpoints, settings.checkpoint_every)
    try:
        resume_step = checkpoints.usable_step()
        with Phase(f"loading the weights of {settings.init_from}", "loaded the weights"):
            params = init_from_lib.initial_weights(settings.init_from, model_config, options, None)
        state = init_train_state(params, optimizer)
        pending = None
        if resume_step is not None:
            state, data_state, _ = checkpoints.restore(resume_step, jax.eval_shape(lambda: state))
            saved = data_state.get("pending")
            pending = None if saved is None else [Rollout.from_dict(r) for r in saved]
    except (CheckpointError, ConfigError, FileNotFoundError) as error:
        raise SystemExit(f"error: {error}") from None
    reference = None
    if grpo.kl_coef:  # the frozen reference: the init_from weights (a copy: steps donate the state)
        reference_params = init_from_lib.initial_weights(settings.init_from, model_config, options, None)
        reference_log_probs = StoredFunction("reference_log_probs", make_reference_log_probs(
            model_config, options, grpo.temperature), (model_config, options, grpo.temperature))
        reference = lambda batch: reference_log_probs(reference_params, batch)  # noqa: E731
    # Stored programs (glm5_jax/programs.py): a restart loads the step instead of compiling it.
    train_step = StoredFunction("train_step", make_train_step(model_config, settings, optimizer,
                                                              options=options),
                                (model_config, settings, options, None))
    schedule = learning_rate_schedule(settings)
    with Phase("starting the rollout engine", "started the rollout engine"):
        worker = RolloutWorker(model_config, state.params, tokenizer, renderer, max_context=seq_len,
                               max_slots=grpo.engine_slots, token_budget=grpo.engine_token_budget,
                               page_size=grpo.engine_page_size, options=options,
                               enable_thinking=grpo.enable_thinking)
        worker.version = int(state.step)
    longest = max(len(worker.prompt_ids(task.messages)) for task in train_tasks + evaluated_tasks)
    if longest >= seq_len:
        worker.shutdown()
        raise SystemExit(f"error: bad config: the longest prompt has {longest} tokens, data.seq_len is "
                         f"{seq_len}: raise data.seq_len above {longest + grpo.max_new_tokens}")
    if longest + grpo.max_new_tokens > seq_len:
        print(f"note: prompts of up to {longest} tokens leave completions {seq_len - longest} of "
              f"grpo.max_new_tokens={grpo.max_new_tokens} tokens in rows of data.seq_len={seq_len}",
              flush=True)
    metrics_log = MetricsLog(workdir, resume_step)

    def prompts_of(tasks, indices):
        return [(index, worker.prompt_ids(tasks[index].messages)) for index in indices]

    def rollouts_for(step: int) -> tuple[list[Rollout], float]:
        indices = prompt_order(len(train_tasks), settings.seed, step, grpo.prompts_per_step)
        rollouts, seconds = worker.generate(
            prompts_of(train_tasks, indices), samples=grpo.group_size, max_new_tokens=grpo.max_new_tokens,
            temperature=grpo.temperature, top_p=grpo.top_p,
            seeds=lambda position, sample: sample_seed(settings.seed, step, position, sample))
        scored = rewards.score([train_tasks[r.task_index] for r in rollouts], [r.text for r in rollouts],
                               in_reasoning=grpo.enable_thinking)
        for rollout, reward in zip(rollouts, scored, strict=True):
            rollout.reward, rollout.parts = reward.total, dict(reward.parts)
        return rollouts, seconds

    def evaluate_held_out() -> dict[str, float]:
        """Greedy answers (heldout/reward) and, with eval_samples, sampled ones at the rollout
        temperature (heldout/sampled_reward: each prompt's mean over its samples, the interval
        over prompts)."""
        if not evaluated_tasks:
            return {}
        prompts = prompts_of(evaluated_tasks, range(len(evaluated_tasks)))
        record = {}
        for name, samples, temperature in (("reward", 1, 0.0), ("sampled_reward", grpo.eval_samples,
                                                                 grpo.temperature)):
            if not samples:
                continue
            rollouts, _ = worker.generate(prompts, samples=samples, max_new_tokens=grpo.max_new_tokens,
                                          temperature=temperature, top_p=grpo.top_p,
                                          seeds=lambda position, sample: sample_seed(settings.seed, -1,
                                                                                     position, sample))
            scored = rewards.score([evaluated_tasks[r.task_index] for r in rollouts],
                                   [r.text for r in rollouts], in_reasoning=grpo.enable_thinking)
            per_prompt = np.array([reward.total for reward in scored]).reshape(-1, samples).mean(axis=1)
            mean, low, high = mean_interval(per_prompt)
            record.update({f"heldout/{name}": mean, f"heldout/{name}_low": low, f"heldout/{name}_high": high})
            if samples == 1:
                record.update({f"heldout/{key}": value for key, value in summary(scored).items()
                               if key != "reward/mean"})
        return record

    # ---------------------------------------------------------------- loop
    stop = StopRequested()
    step = int(state.step)
    if step == 0:
        with Phase("step 0: answering the held-out prompts (the engine compiles its steps first)",
                   "step 0: evaluated"):
            evaluation = evaluate_held_out()
        metrics_log.write(0, evaluation)
        print("step 0: " + " ".join(f"{k} {v:.4f}" for k, v in evaluation.items()), flush=True)
    last_saved = resume_step
    first_step = True
    sampler = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="glm5-rollouts")
    progress = tqdm(total=settings.num_train_steps, initial=step, unit="step", dynamic_ncols=True,
                    mininterval=1.0, file=sys.stdout)
    while step < settings.num_train_steps and not stop.agreed():
        started = time.perf_counter()
        if pending is None:  # on-policy, or the first step: sample with the current weights
            rollouts, rollout_seconds = rollouts_for(step + 1)
        else:
            rollouts, rollout_seconds = pending, 0.0
        pending = None
        batch, statistics = grpo_batch(
            rollouts, group_size=grpo.group_size, seq_len=seq_len, min_rows=settings.batch_size,
            advantage=grpo.advantage, advantage_eps=grpo.advantage_eps, aggregation=grpo.aggregation,
            max_new_tokens=grpo.max_new_tokens, grad_accum_steps=settings.grad_accum_steps)
        if reference is not None:
            batch["reference_log_probs"] = reference(batch)
        ahead = None  # off-policy: the next step's rollouts, sampled with these weights as this one trains
        if grpo.off_policy and step + 1 < settings.num_train_steps:
            ahead = sampler.submit(rollouts_for, step + 2)
        compiling = Phase(f"step {step + 1}: compiling the train step for {statistics['rows']} rows",
                          f"step {step + 1}: compiled and ran", tqdm.write) if first_step else None
        trained = time.perf_counter()
        state, metrics = train_step(state, batch)
        loss = float(metrics["loss"])
        train_seconds = time.perf_counter() - trained
        if ahead is not None:
            pending, ahead_seconds = ahead.result()
            rollout_seconds += ahead_seconds
        step += 1
        if compiling is not None:
            compiling.done(f"loss {loss:.4f}")
            first_step = False
        worker.hand_off(state.params, step)
        seconds = time.perf_counter() - started
        scores = summary([_as_reward(r) for r in rollouts])
        completion_tokens = sum(len(r.completion_ids) for r in rollouts)
        if not bool(metrics["finite"]):
            tqdm.write(f"step {step}: non-finite loss or gradient; update skipped")
        progress.update(1)
        progress.set_postfix(reward=f"{scores['reward/mean']:.3f}", loss=f"{loss:.3f}",
                             step_s=f"{seconds:.2f}")
        if step % settings.log_every == 0 or step == settings.num_train_steps:
            record = {key: metrics[key] for key in ("loss", "pg_loss", "kl", "clip_fraction", "ratio_mean",
                                                   "ratio_max", "log_prob_gap", "mtp_loss", "grad_norm")
                      if key in metrics}
            record.update(scores)
            record.update({
                "reward/std": float(np.std([r.reward for r in rollouts])),
                "staleness": float(np.mean([step - 1 - r.version for r in rollouts])),
                "completion_tokens_mean": completion_tokens / len(rollouts),
                "truncated_share": float(np.mean([r.finish_reason == "length" for r in rollouts])),
                "zero_advantage_groups": statistics["zero_advantage_groups"],
                "rows": statistics["rows"], "padding_share": statistics["padding_share"],
                "rollout_seconds": rollout_seconds, "train_seconds": train_seconds, "step_seconds": seconds,
                "rollout_tokens_per_second": completion_tokens / max(rollout_seconds, 1e-9)
                if rollout_seconds else 0.0,
                "learning_rate": float(schedule(step - 1)), "skipped": not bool(metrics["finite"])})
            metrics_log.write(step, record)
        if step % settings.eval_every == 0 or step == settings.num_train_steps:
            evaluation = evaluate_held_out()
            metrics_log.write(step, evaluation)
            tqdm.write(f"step {step}: " + " ".join(f"{k} {v:.4f}" for k, v in evaluation.items()))
        if checkpoints.due(step) or step == settings.num_train_steps:
            checkpoints.save(step, state, _data_state(pending), run_config)
            last_saved = step
    progress.close()
    sampler.shutdown()
    if stop.stopping and last_saved != step:
        checkpoints.save(step, state, _data_state(pending), run_config)
    worker.shutdown()
    checkpoints.close()
    metrics_log.close()
    if stop.stopping:
        print(f"{stop.signal_name}: saved checkpoint at step {step} in {workdir}; "
              "run the same command to resume.")
    else:
        print(f"done: {step} steps; checkpoints in {checkpoints.directory}")


def _as_reward(rollout: Rollout) -> Reward:
    return Reward(total=rollout.reward, parts=rollout.parts)


def _data_state(pending: list[Rollout] | None) -> dict:
    """The data state saved with a checkpoint: the next step's rollouts when already sampled."""
    return {"pending": None if pending is None else [vars(r) for r in pending]}
