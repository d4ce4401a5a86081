"""The OpenAI-compatible HTTP API (FastAPI) over the engine (glm5_jax/engine/).

    app.py        create_app(engine, model_id, ...): the app factory (state, routers, error handlers,
                  request counting)
    state.py      AppState: what every route shares (engine, tokenizer, renderer, limits, metrics), held
                  on app.state; its checks and request building; the API-key and drain dependencies
    body.py       reading a request body (size cap, deadline, JSON depth, lone surrogates)
    routes/       one module per endpoint group: completions.py (/v1/completions), chat.py
                  (/v1/chat/completions), tokenize.py (/tokenize, /detokenize, /tokenizer_info),
                  models.py (/v1/models), health.py (/health, /metrics), feedback.py (/v1/feedback)
    protocol.py   the API's request bodies; logprobs.py  the OpenAI log-probability formats
    choices.py    n choices per prompt as engine requests, and the JSON or SSE answer they make
    accounting.py usage (cached tokens) and rate-limit settlement around a request stream
    chat_output.py one chat choice's text -> OpenAI deltas and message (reasoning, content, tool calls)
    chat_constraints.py  tool_choice and response_format -> the engine's Constraint
    feedback.py   an answer's feedback-log record, and answering POST /v1/feedback
    errors.py     OpenAI-style error bodies and the app's exception handlers
    limits.py     RateLimiter: requests- and tokens-per-minute limits per API key
    metrics.py    ServerMetrics: Prometheus metrics (its own registry per server)
    server_config.py  the server config file (aliases, API keys, limits)
    http_server.py  uvicorn with read deadlines, a connection limit and a graceful drain

The chat template, the reasoning and tool-call formats and the feedback log itself live in
glm5_jax/chat/ (data preparation and training use them too). Nothing is imported here, so that the
API can be tested without JAX: import the submodule you need. `python serve.py` runs a server.
"""
