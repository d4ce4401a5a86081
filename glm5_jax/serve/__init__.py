"""Serving GLM-5 models over an OpenAI-compatible HTTP API.

    types.py     SamplingParams, GenerationEvent (request types; InvalidRequestError: glm5_jax/errors.py)
    sampling.py  the batched sampler (temperature, top-k/p, min-p, penalties, logprobs)
    engine.py    Engine: continuous batching on a paged latent cache, chunked prefill under a token
                 budget, preemption, prefix caching with host offload
    paged_cache.py  page hash chain and PageAllocator (ref counts, LRU, host offload)
    observer.py  EngineObserver: the engine's metric hooks
    metrics.py   ServerMetrics: Prometheus metrics (its own registry per server)
    limits.py    RateLimiter: requests- and tokens-per-minute limits per API key
    server_config.py  the server config file (aliases, API keys, limits)
    accounting.py  usage (cached tokens) and rate-limit settlement around a request stream
    textstream.py  engine events -> text (incremental detokenising, stop strings)
    chat_output.py one chat choice's text -> OpenAI deltas and message (reasoning, content, tool calls)
    chat_constraints.py  tool_choice and response_format -> the engine's Constraint
    protocol.py  the API's request bodies; logprobs.py  the OpenAI log-probability formats
    choices.py   n choices per prompt as engine requests, and the JSON or SSE answer they make
    feedback.py  an answer's feedback-log record, and POST /v1/feedback
    http_server.py  uvicorn with read deadlines, a connection limit and a graceful drain
    api.py       create_app(engine, model_id, ...): the FastAPI app (/v1/completions, /v1/chat/completions,
                 /v1/models, /health, /metrics, /tokenize, /detokenize)

The chat template, the reasoning and tool-call formats and the feedback log itself live in
glm5_jax/chat/ (data preparation and training use them too).

Nothing is imported here, so that using the engine needs neither FastAPI nor jinja2 and the API
can be tested without JAX: import the submodule you need. `python serve.py` runs a server.
"""
