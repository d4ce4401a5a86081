"""Reinforcement learning from verifiable rewards (GRPO, issue #42): prompts with checkable answers,
the verifiers that score the policy's completions, rollouts from the serving engine, and the loop.

    tasks.py     RLTask (a chat prompt plus what its verifier needs) and load_tasks(spec, seed):
                 templated arithmetic, the stdlib doctest code problems, templated JSON objects,
                 user JSONL; (train, held-out) splits disjoint by prompt; write_sft_set for the
                 SFT warm-up that gives the demo model a non-zero initial reward
    rewards.py   the verifiers (exact-match arithmetic, sandboxed code, JSON schema, a user Python
                 function) and make_rewards(config.rewards) -> Rewards: weighted totals per
                 completion, the parts by name and their logged means
    rollouts.py  G sampled completions per prompt from the project's engine with the policy's
                 current weights, and their log-probabilities
    batches.py   rollouts -> one GRPO train batch: completions packed whole into rows with the
                 per-token fields the loss (glm5_jax/train/grpo.py) reads
    loop.py      the GRPO training loop (config.objective = "grpo")

A floor above train, engine, evaluate, data and chat: it imports them; nothing below imports it.
"""
