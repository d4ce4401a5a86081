"""Serving GLM-5 models over an OpenAI-compatible HTTP API.

    types.py     SamplingParams, GenerationEvent, InvalidRequestError (shared request types)
    sampling.py  the batched sampler (temperature, top-k/p, min-p, penalties, logprobs)
    engine.py    Engine: continuous batching on a paged latent cache, chunked prefill under a token
                 budget, preemption, prefix caching with host offload
    paged_cache.py  page hash chain and PageAllocator (ref counts, LRU, host offload)
    observer.py  EngineObserver: the engine's metric hooks
    metrics.py   ServerMetrics: Prometheus metrics (its own registry per server)
    limits.py    RateLimiter: requests- and tokens-per-minute limits per API key
    server_config.py  the server config file (aliases, API keys, limits)
    accounting.py  usage (cached tokens) and rate-limit settlement around a request stream
    chat.py      ChatRenderer, load_chat_template, load_special_tokens: messages -> prompt text
    textstream.py  engine events -> text (incremental detokenising, stop strings)
    reasoning.py   the <think> block of chat output -> reasoning_content
    tool_calls.py  GLM-5 tool-call markup in chat output -> OpenAI tool_calls
    chat_output.py one chat choice's text -> OpenAI deltas and message (reasoning, content, tool calls)
    chat_constraints.py  tool_choice and response_format -> the engine's Constraint
    protocol.py  the API's request bodies; logprobs.py  the OpenAI log-probability formats
    choices.py   n choices per prompt as engine requests, and the JSON or SSE answer they make
    api.py       create_app(engine, model_id, ...): the FastAPI app (/v1/completions, /v1/chat/completions,
                 /v1/models, /health, /metrics, /tokenize, /detokenize)

Nothing is imported here, so that using the engine needs neither FastAPI nor jinja2 and the API
can be tested without JAX: import the submodule you need. `python serve.py` runs a server.
"""
