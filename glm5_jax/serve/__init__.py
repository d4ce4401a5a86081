"""Serving GLM-5 models over an OpenAI-compatible HTTP API.

    types.py     SamplingParams, GenerationEvent, InvalidRequestError (shared request types)
    sampling.py  the batched sampler (temperature, top-k/p, min-p, penalties, logprobs)
    engine.py    Engine: continuous batching over a fixed number of slots, one request stream each
    chat.py      ChatRenderer, load_chat_template, load_special_tokens: messages -> prompt text
    textstream.py  engine events -> text (incremental detokenising, stop strings)
    api.py       create_app(engine, model_id, ...): the FastAPI app (/v1/completions, /v1/chat/completions,
                 /v1/models, /health)

Nothing is imported here, so that using the engine needs neither FastAPI nor jinja2 and the API
can be tested without JAX: import the submodule you need. `python serve.py` runs a server.
"""
