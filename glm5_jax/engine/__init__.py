"""The serving engine: continuous batching of GLM-5 requests on a paged latent cache.

    types.py        SamplingParams, Constraint, GenerationEvent and the engine's errors (request types;
                    InvalidRequestError: glm5_jax/errors.py)
    engine.py       Engine: a supervised thread that runs the scheduler's plans on the runner and delivers
                    token events to each request's asyncio stream
    scheduler.py    what each step computes (pure Python): admission, chunked prefill under a token budget,
                    preemption, prefix caching, pages
    paged_cache.py  page hash chain and PageAllocator (ref counts, LRU, host offload)
    runner.py       ModelRunner: parameters, page pool, sampler state and the device step programs
                    (ahead-of-time compiled, kept for restarts: glm5_jax/programs.py)
    delivery.py     a call's sampled tokens -> each request's Burst (finish checks per request, not token)
    timing.py       opt-in host time per device call by phase and the device's idle share
    batches.py      a scheduler plan -> the runner's host arrays (tokens, positions, block tables, stop ids)
    sampling.py     the batched sampler (SlotOptions: temperature, top-k/p, min-p, penalties; keys, logprobs)
    speculative.py  MTP speculative decoding (drafts, one verify chunk per row)
    rejection_sampling.py  speculative decoding's accept/reject rule
    grammar.py      constrained output (regex / JSON schema / tool calls) as per-step token bitmasks
    textstream.py   engine events -> text (incremental detokenising, stop strings), for the API and the
                    in-process evaluator
    observer.py     EngineObserver: the engine's metric hooks (the API's metrics subclass it)

Nothing here imports glm5_jax.api: the engine runs without FastAPI (generate, evaluation). Nothing is
imported here either: import the submodule you need.
"""
