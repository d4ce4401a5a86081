"""Serve a GLM-5-architecture model over an OpenAI-compatible HTTP API.

    python serve.py --checkpoint runs/demo --host 127.0.0.1 --port 8000
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \
        -d '{"model": "demo", "prompt": "def fibonacci(n):", "max_tokens": 64}'

The checkpoint is an HF-layout directory (config.json, safetensors, tokenizer.json and optionally
a chat template) or a train.py run directory (checkpoints/, tokenizer.json). Any OpenAI client
works: point its base_url at http://HOST:PORT/v1 and use the served model id (by default the
checkpoint directory's name) or one of its aliases. `--server-config FILE` (configs/serve_example.py)
gives aliases, API keys and per-key rate limits; /metrics serves Prometheus metrics. Execution
options (--dtype, --moe-impl, --scan-unroll, --attention-impl, --indexer-impl,
--decode-attention-impl, --quantized-matmul) start
from the checkpoint's (a run's `execution` section, an HF checkpoint's stored dtype), e.g.
`--decode-attention-impl pallas` serves through the Pallas ragged paged-attention kernel.
`--mesh tensor=2,expert=4` serves on a device mesh (the syntax of `python -m glm5_jax.plan
--mesh`): heads, MLP units and vocab over tensor, routed experts over expert. If the engine
fails for good (engine.failure is set), the server stops and the process exits with status 1, so
that a supervisor (systemd, Kubernetes) restarts it. `--feedback-dir DIR` records every answer in DIR
and lets clients rate them with POST /v1/feedback (docs/feedback.md). See docs/serving.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

# The execution and cache flags' one definition (plain tuples and argparse: --help needs no JAX).
from glm5_jax.compile_cache import add_compilation_cache_flags
from glm5_jax.execution_flags import EXECUTION_FLAGS, add_execution_flags
from glm5_jax.execution_flags import QUANTIZED_MATMUL_IMPLS as QUANTIZED_MATMUL_CHOICES  # noqa: F401

DEFAULT_RUN = Path("runs/demo")
WAITING_PER_SLOT = 8  # --max-waiting's default, per --max-slots
DEFAULT_DECODE_STEPS = 8  # glm5_jax.engine.engine.DEFAULT_DECODE_STEPS (a test checks they agree)

def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=None,
                        help=f"an HF checkpoint directory or a train.py run directory "
                             f"(default: {DEFAULT_RUN} when it exists)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default: 127.0.0.1; 0.0.0.0 exposes the server to "
                             "the network)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port to listen on (default: 8000)")
    parser.add_argument("--model-id", default=None,
                        help="model name clients must send (default: the checkpoint directory's name)")
    parser.add_argument("--api-key", default=os.environ.get("GLM5_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1/* (default: $GLM5_API_KEY; "
                             "unset means no key)")
    parser.add_argument("--max-slots", type=int, default=8,
                        help="requests decoded together in one batch; more wait in a queue (default: 8)")
    parser.add_argument("--max-waiting", type=int, default=None,
                        help="most requests waiting for a slot; more are refused with 503 and Retry-After "
                             f"(default: {WAITING_PER_SLOT} x --max-slots; 0 = unbounded)")
    parser.add_argument("--max-body-bytes", type=int, default=None,
                        help="larger request bodies are refused with 413 (default: 4 MiB)")
    parser.add_argument("--read-timeout", type=float, default=30.0, metavar="SECONDS",
                        help="a request's head (headers) and then its body must each arrive within this "
                             "long, else 408 and the connection is closed (default: 30)")
    parser.add_argument("--limit-concurrency", type=int, default=1024, metavar="N",
                        help="open connections (or running requests) past which new requests get 503 at "
                             "once (default: 1024)")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                        help="on SIGTERM or Ctrl-C: stop accepting, answer queued requests 503, give running "
                             "ones this long to finish, then end them (a streamed answer gets finish_reason "
                             "\"abort\", an error event and [DONE]) and exit 0 (default: 30)")
    parser.add_argument("--max-context", type=int, default=1024,
                        help="most tokens (prompt + output) of one request (default: 1024)")
    parser.add_argument("--server-config", default=None,
                        help="server config file: model aliases, API keys and their per-minute limits "
                             "(a get_config() Python file like configs/serve_example.py, or .json)")
    parser.add_argument("--page-size", type=int, default=16,
                        help="tokens per cache page; prefix caching reuses whole pages (default: 16)")
    parser.add_argument("--num-pages", type=int, default=None,
                        help="device cache pages in all (default: the engine's choice)")
    parser.add_argument("--token-budget", type=int, default=256,
                        help="prefill tokens one engine step processes next to the running decodes "
                             "(chunked prefill; default: 256)")
    parser.add_argument("--decode-steps", type=int, default=DEFAULT_DECODE_STEPS,
                        help="decode steps one device call runs when every request is decoding "
                             f"(default: {DEFAULT_DECODE_STEPS})")
    parser.add_argument("--speculative-tokens", type=int, default=0, metavar="N",
                        help="MTP speculative decoding: the checkpoint's MTP layer drafts N tokens per "
                             "decode round, the model verifies them in one step (vLLM's --speculative-config "
                             "method mtp; GLM-5 uses 3). Greedy output is unchanged; sampled output keeps "
                             "its distribution (default: 0, off)")
    parser.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="reuse cached pages of earlier prompts with the same prefix (default: on)")
    parser.add_argument("--noprefix-caching", dest="prefix_caching", action="store_false",
                        help="same as --no-prefix-caching")
    parser.add_argument("--state-snapshots", type=int, default=None, metavar="N",
                        help="hybrid (glm5_next) models: device slots for the KDA state snapshots that "
                             "prefix caching keeps at cached page boundaries, each the size of one "
                             "sequence's KDA state (docs/serving.md, \"Hybrid models\"; default: "
                             "--max-slots; 0 = prefix caching off for them); ignored for other models")
    parser.add_argument("--host-cache-pages", type=int, default=0,
                        help="host-memory pages that evicted prefix pages are offloaded to (default: 0, "
                             "no offload)")
    parser.add_argument("--reuse-host-memory", action=argparse.BooleanOptionalAction, default=True,
                        help="keep freed host memory for reuse (glibc malloc: one heap, never trimmed), so "
                             "a CPU step's temporaries do not page-fault in again each step; the process "
                             "keeps its peak memory (default: on; glm5_jax/host_memory.py)")
    parser.add_argument("--mesh", default=None, metavar="AXES",
                        help="serve on a device mesh, e.g. tensor=2,expert=4 or expert=8 (axes tensor, "
                             "expert, data; sizes multiply to the device count; default: one device)")
    parser.add_argument("--distributed", choices=("auto", "on", "off"), default="auto",
                        help="join jax.distributed to serve from several processes (docs/serving.md): auto "
                             "when the environment names a coordinator (JAX_COORDINATOR_ADDRESS, ...) or a "
                             "SLURM / Open MPI job of several tasks; on: let JAX detect the cluster (a Cloud "
                             "TPU pod); off: one process (default: auto)")
    parser.add_argument("--quantize", default=None, metavar="RECIPE",
                        help="quantize the weights on load with this recipe name or file "
                             "(glm5_jax.train.runs.load_any; default: as stored)")
    add_execution_flags(parser, EXECUTION_FLAGS)
    add_compilation_cache_flags(parser)
    parser.add_argument("--reasoning-parser", choices=("glm45", "none"), default="glm45",
                        help="chat answers: glm45 returns the <think> block as reasoning_content (and "
                             "reasoning) apart from content, as vLLM's --reasoning-parser glm45 does; none "
                             "leaves it in content (default: glm45)")
    parser.add_argument("--default-chat-template-kwargs", default=None, metavar="JSON",
                        help="chat template variables every chat request starts from (its own "
                             "chat_template_kwargs win), as vLLM's flag: e.g. '{\"enable_thinking\": true}'. "
                             "Default: the checkpoint's template defaults (GLM-5: thinking on); for a "
                             "train.py run, {\"enable_thinking\": false}: such a model has not learned to "
                             "think (its chat fine-tuning answers after </think>), and with thinking on "
                             "its whole answer would land in reasoning_content")
    parser.add_argument("--feedback-dir", default=None, metavar="DIR",
                        help="collect feedback: append every answer (request, response, confidence) to JSONL "
                             "files in DIR (created if missing) and accept ratings of response ids with POST "
                             "/v1/feedback; the records hold users' text unredacted, so keep DIR private "
                             "(export with python -m glm5_jax.data.feedback; default: off)")
    parser.add_argument("--log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug"],
                        help="uvicorn log level (default: info)")
    args = parser.parse_args(argv)
    if args.max_slots < 1:
        parser.error(f"--max-slots must be >= 1, got {args.max_slots}")
    if args.max_context < 2:
        parser.error(f"--max-context must be >= 2, got {args.max_context}")
    for flag, value, least in (("--page-size", args.page_size, 1), ("--num-pages", args.num_pages, 1),
                               ("--token-budget", args.token_budget, 1),
                               ("--decode-steps", args.decode_steps, 1),
                               ("--speculative-tokens", args.speculative_tokens, 0),
                               ("--host-cache-pages", args.host_cache_pages, 0),
                               ("--max-waiting", args.max_waiting, 0),
                               ("--max-body-bytes", args.max_body_bytes, 1),
                               ("--limit-concurrency", args.limit_concurrency, 1)):
        if value is not None and value < least:
            parser.error(f"{flag} must be >= {least}, got {value}")
    for flag, value in (("--read-timeout", args.read_timeout), ("--shutdown-timeout", args.shutdown_timeout)):
        if not value >= 0 or (flag == "--read-timeout" and value == 0):
            parser.error(f"{flag} must be {'> 0' if flag == '--read-timeout' else '>= 0'}, got {value}")
    if args.default_chat_template_kwargs is not None:
        try:
            args.default_chat_template_kwargs = json.loads(args.default_chat_template_kwargs)
        except ValueError as exc:
            parser.error(f"--default-chat-template-kwargs is not JSON: {exc}")
        if not isinstance(args.default_chat_template_kwargs, dict):
            parser.error("--default-chat-template-kwargs must be a JSON object")
        asked = set(args.default_chat_template_kwargs)
        if reserved := sorted({"messages", "tools", "add_generation_prompt"} & asked):
            parser.error(f"--default-chat-template-kwargs must not set {', '.join(reserved)}")
    if args.max_waiting is None:
        args.max_waiting = WAITING_PER_SLOT * args.max_slots
    return args


def read_server_config(path: str | None):
    """The server config (defaults when no file is given); exits with the field at fault."""
    from glm5_jax.api.server_config import ServerConfig, ServerConfigError, load_server_config
    from glm5_jax.model.config import ConfigError

    if path is None:
        return ServerConfig()
    try:
        return load_server_config(path)
    except (ServerConfigError, ConfigError) as exc:
        sys.exit(f"error: --server-config: {exc}")


def open_feedback_log(directory: str | None):
    """The feedback log over DIR (None when not asked for); exits when DIR cannot be created or written."""
    from glm5_jax.chat.feedback_log import FeedbackLog, FeedbackLogError

    if directory is None:
        return None
    try:
        return FeedbackLog(directory)
    except FeedbackLogError as exc:
        sys.exit(f"error: --feedback-dir: {exc}")


def resolve_checkpoint(checkpoint: str | None) -> Path:
    """The directory to serve; exits with advice when none is given and there is no demo run."""
    if checkpoint is not None:
        path = Path(checkpoint)
        if not path.is_dir():
            sys.exit(f"error: --checkpoint {checkpoint} is not a directory")
        return path
    if (DEFAULT_RUN / "checkpoints").is_dir():
        return DEFAULT_RUN
    sys.exit(f"error: no --checkpoint given and {DEFAULT_RUN} has no checkpoints; train the demo "
             "model first with `python train.py --config configs/demo.py`, or pass --checkpoint DIR")


def default_template_kwargs(checkpoint: Path, asked: dict | None) -> dict:
    """What chat requests start from: --default-chat-template-kwargs, else thinking off for a
    train.py run (a directory with checkpoints/), else the template's own defaults."""
    if asked is not None:
        return asked
    return {"enable_thinking": False} if (checkpoint / "checkpoints").is_dir() else {}


def serve_until_failure(server, engine, poll_seconds: float = 0.5, linger_seconds: float = 0.0) -> str | None:
    """Runs the uvicorn `server` until it stops, stopping it (gracefully) once engine.failure is set,
    after `linger_seconds` in which /health answers 503 with the reason; returns that failure
    (None: the server stopped for another reason, e.g. Ctrl-C)."""
    stopped = threading.Event()

    def watch():  # a thread, so that server.run() keeps uvicorn's own choice of event loop
        while not stopped.wait(poll_seconds):
            if engine.failure is not None:
                stopped.wait(linger_seconds)
                server.should_exit = True  # uvicorn's main loop checks it every 0.1 s
                return

    threading.Thread(target=watch, name="engine-failure-watch", daemon=True).start()
    try:
        server.run()
    finally:
        stopped.set()
    return engine.failure


class WarmUpLog:
    """Engine.warm_up's on_progress: a line per step shape compiled, with the time so far and an
    estimate of the time left (the shapes left at the mean rate so far)."""

    def __init__(self, started: float):
        self.started = started

    def __call__(self, done: int, total: int) -> None:
        elapsed = time.monotonic() - self.started
        left = elapsed / done * (total - done)
        print(f"compiled step shape {done} of {total} ({elapsed:.1f} s; about {left:.0f} s left)", flush=True)


def announce_ready(engine, warmed: threading.Event, cache_dir: str | None, started: float, hits) -> None:
    """Waits for the warm-up and says the server is ready (a failed warm-up is the engine's
    failure: serve_until_failure stops the server and serve.py exits 1). hits: a CacheHits."""
    from glm5_jax.compile_cache import cache_entries

    warmed.wait()
    if engine.failure is None:
        print(f"ready: {engine.warm_up_total} step shapes warm in {time.monotonic() - started:.1f} s "
              f"({engine.runner.programs.loaded} step programs loaded from the program store; "
              f"{engine.compile_count} programs compiled or loaded from the compilation cache since the "
              f"engine started, {hits.count} loaded from it in all, which holds {cache_entries(cache_dir)})",
              flush=True)


class Processes(NamedTuple):
    index: int
    count: int


def jax_processes(distributed: bool, mesh: str | None) -> Processes | None:
    """This process's place in a multi-process server (None: one process). Several processes
    serve one model on a mesh over all their devices (docs/serving.md), so --mesh is required."""
    if not distributed:
        return None
    import jax

    if jax.process_count() == 1:
        return None
    if not mesh:
        sys.exit("error: serving from several processes needs --mesh over all their devices (e.g. "
                 "--mesh tensor=2,expert=2 for 2 processes of 2 devices)")
    return Processes(jax.process_index(), jax.process_count())


def cross_process_axes(mesh) -> str:
    """Which mesh axes cross processes (their collectives travel between hosts) and which stay
    inside one, e.g. "expert across processes, tensor within"."""
    from glm5_jax.parallel.mesh import axes_across_processes

    across, within = axes_across_processes(mesh)
    return f"{', '.join(across) or 'no axis'} across processes, {', '.join(within) or 'no axis'} within"


def mesh_shardings(text: str, placed: dict, config, params=None):
    """The served weights' shardings (shaped like `params`, float weights when None) on the mesh
    `text` names; the mesh goes into placed["mesh"]."""
    from glm5_jax.model.config import mesh_requirements
    from glm5_jax.model.transformer import param_logical_axes
    from glm5_jax.parallel.mesh import MeshError, MeshSpec, make_mesh
    from glm5_jax.parallel.sharding import serving_param_shardings

    if "mesh" not in placed:
        spec = MeshSpec.parse(text)
        if spec.pipeline != 1 or spec.fsdp != 1 or spec.context != 1:
            raise MeshError(f"--mesh {text}: serving splits over tensor, expert and data only "
                            "(no pipeline, fsdp or context axis)")
        placed["mesh"] = make_mesh(spec, mesh_requirements(config))
    return serving_param_shardings(param_logical_axes(config), placed["mesh"], params)


def main(argv=None) -> int:
    """Serves until stopped: 0 after Ctrl-C / SIGTERM (drained), 1 when the engine failed."""
    args = parse_args(argv)
    if args.reuse_host_memory:  # before JAX starts its CPU threads
        from glm5_jax.host_memory import reuse_freed_memory

        reuse_freed_memory()
    from glm5_jax.compile_cache import CacheHits, cache_entries, enable_compilation_cache, stored_programs

    cache_dir = enable_compilation_cache(args.compilation_cache_dir)  # before anything compiles
    hits = CacheHits()
    checkpoint = resolve_checkpoint(args.checkpoint)
    server_config = read_server_config(args.server_config)  # before the slow model load
    from glm5_jax.parallel.distributed import initialize_distributed
    processes = jax_processes(initialize_distributed(mode=args.distributed), args.mesh)
    feedback_log = open_feedback_log(args.feedback_dir)
    # Imported here: loading JAX and the model is slow, and `--help` should not need it.
    from glm5_jax.api.app import create_app
    from glm5_jax.api.body import DEFAULT_MAX_BODY_BYTES
    from glm5_jax.api.http_server import make_server, raise_open_file_limit
    from glm5_jax.api.metrics import ServerMetrics
    from glm5_jax.chat.template import load_chat_template, load_special_tokens
    from glm5_jax.engine.engine import Engine
    from glm5_jax.model.config import ConfigError
    from glm5_jax.model.paged_decode import state_bytes_per_sequence
    from glm5_jax.parallel.mesh import MeshError
    from glm5_jax.train.runs import RunNotFoundError, checkpoint_options, load_any

    # quantize is passed only when asked for, so loading works with any load_any.
    load_options = {} if args.quantize is None else {"quantize": args.quantize}
    placed = {}
    if args.mesh:
        load_options["shardings"] = functools.partial(mesh_shardings, args.mesh, placed)
    try:
        config, params, tokenizer = load_any(checkpoint, **load_options)
        options = checkpoint_options(checkpoint).replace(
            **{name: getattr(args, name) for name in EXECUTION_FLAGS if getattr(args, name) is not None})
    except (RunNotFoundError, ConfigError, MeshError, ValueError) as exc:
        sys.exit(f"error: {exc}")
    if tokenizer is None:
        sys.exit(f"error: {checkpoint} has no tokenizer.json; the server needs it to read and write text")
    if args.speculative_tokens and config.has_linear_layers:
        sys.exit(f"error: --speculative-tokens is not available for {checkpoint}, a hybrid (GLM-5.3-Flash, "
                 "glm5_next) model: its MTP layer is not loaded, and a rejected draft would have to roll the "
                 "KDA state back; serve it without --speculative-tokens")
    if args.speculative_tokens and not config.num_mtp_layers:
        sys.exit(f"error: --speculative-tokens drafts with the model's MTP layer, and {checkpoint} has none "
                 "(num_nextn_predict_layers = 0); serve it without --speculative-tokens")
    if processes and processes.index != 0:  # a follower: no HTTP, process 0's runner calls
        from glm5_jax.engine.multihost import CommandChannel, follow
        print(f"process {processes.index} of {processes.count}: serving process 0's steps", flush=True)
        follow(CommandChannel(), config, params, placed["mesh"])
        return 0
    model_id = args.model_id or server_config.model_id or checkpoint.resolve().name
    template_defaults = default_template_kwargs(checkpoint, args.default_chat_template_kwargs)
    metrics = ServerMetrics()
    runner = {}
    if processes:
        from glm5_jax.engine.multihost import CommandChannel, mirrored_runner_factory
        runner["runner_factory"] = mirrored_runner_factory(CommandChannel())
    engine = Engine(config, params, tokenizer, max_slots=args.max_slots, max_context=args.max_context,
                    page_size=args.page_size, num_pages=args.num_pages, token_budget=args.token_budget,
                    prefix_caching=args.prefix_caching, host_cache_pages=args.host_cache_pages,
                    max_waiting=args.max_waiting or None, decode_steps=args.decode_steps, observer=metrics,
                    options=options, mesh=placed.get("mesh"), speculative_tokens=args.speculative_tokens,
                    state_snapshots=args.state_snapshots, **runner)
    del params  # the engine holds what it serves (per-layer arrays when unrolled): free the loaded stacks
    app = create_app(engine, model_id, api_key=args.api_key, chat_template=load_chat_template(checkpoint),
                     special_tokens=load_special_tokens(checkpoint), server_config=server_config,
                     metrics=metrics, max_body_bytes=args.max_body_bytes or DEFAULT_MAX_BODY_BYTES,
                     reasoning_parser=args.reasoning_parser, feedback_log=feedback_log,
                     body_timeout_s=args.read_timeout,
                     default_template_kwargs=template_defaults)
    # Listen at once and compile in the background: until every step shape is compiled, /health
    # answers 503 "starting" with the progress and generation requests 503 with Retry-After.
    print(f"compiling the engine's step shapes in the background (compilation cache: "
          f"{cache_dir or 'off'}, {cache_entries(cache_dir)} programs in it, {stored_programs(cache_dir)} "
          "compiled step programs in its program store)", flush=True)
    started = time.monotonic()
    warmed = engine.warm_up(wait=False, on_progress=WarmUpLog(started))
    threading.Thread(target=announce_ready, args=(engine, warmed, cache_dir, started, hits),
                     name="warm-up-watch", daemon=True).start()
    aliases = f" (aliases: {', '.join(server_config.model_aliases)})" if server_config.model_aliases else ""
    on = f", mesh {args.mesh}" if args.mesh else ""
    if processes:
        on += f" over {processes.count} processes ({cross_process_axes(placed['mesh'])})"
    print(f"serving {model_id!r}{aliases} from {checkpoint} at http://{args.host}:{args.port}/v1 once "
          f"compiled (max_context {engine.max_context}, {args.max_slots} slots{on}, metrics at /metrics; "
          f"{options.dtype}, moe_impl {options.moe_impl}, scan_unroll {options.scan_unroll}, "
          f"decode attention {options.decode_attention_impl})",
          flush=True)
    if engine.prefix_caching_off:
        print(engine.prefix_caching_off, flush=True)
    elif engine.state_snapshots:
        print(f"prefix caching with {engine.state_snapshots} KDA state snapshots of "
              f"{state_bytes_per_sequence(config, options.compute_dtype) / 2**20:.1f} MiB", flush=True)
    if template_defaults:
        print(f"chat requests start from chat_template_kwargs {json.dumps(template_defaults)} "
              "(--default-chat-template-kwargs)", flush=True)
    if feedback_log is not None:
        print(f"collecting feedback in {feedback_log.path} (POST /v1/feedback)", flush=True)
    raise_open_file_limit()  # each connection is a file
    server = make_server(app, engine, host=args.host, port=args.port, log_level=args.log_level,
                         shutdown_timeout_s=args.shutdown_timeout, header_timeout_s=args.read_timeout,
                         limit_concurrency=args.limit_concurrency)
    failure = None
    watch = None
    if processes:  # a follower that stops fails the job (/health says so first)
        from glm5_jax.engine.multihost import FollowerWatch
        watch = FollowerWatch(functools.partial(setattr, engine, "failure"))
    try:
        failure = serve_until_failure(server, engine, linger_seconds=2.0 if processes else 0.0)
    except KeyboardInterrupt:  # a second Ctrl-C during the drain
        pass
    finally:
        if watch is not None:
            watch.stop()
        if processes and failure is not None:
            # The engine thread may wait in a collective with the lost process: end now, not at
            # JAX's shutdown barrier.
            print(f"error: {failure}", file=sys.stderr, flush=True)
            os._exit(1)
        engine.shutdown()
        if processes:
            engine.runner.close()  # the followers stop and exit 0
        if feedback_log is not None:
            feedback_log.close()  # waits for the records still being written
    if failure is not None:
        print(f"error: the engine failed and cannot go on: {failure}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
