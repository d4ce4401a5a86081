"""python -m glm5_jax.evaluate: run an evaluation suite on a checkpoint or a server, or compare runs.

    python -m glm5_jax.evaluate --checkpoint runs/demo --suite local
    python -m glm5_jax.evaluate --checkpoint runs/demo --suite local --quantize mixed
    python -m glm5_jax.evaluate --checkpoint configs/demo.py --tokenizer runs/demo/tokenizer.json \
        --suite local
    python -m glm5_jax.evaluate --server http://127.0.0.1:8000 --suite local
    python -m glm5_jax.evaluate --compare A/results.json B/results.json --output compare/

Writes results.json, samples.jsonl, report.md, report.html (self-contained: the plot embedded) and
scores.png (with matplotlib) to --output; --compare writes compare.md, compare.html and compare.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from glm5_jax.checkpoint import CheckpointError
from glm5_jax.config_files import add_execution_flags, execution_from_flags
from glm5_jax.evaluate import report
from glm5_jax.evaluate.backend import ServerError
from glm5_jax.evaluate.formats import TaskDataError
from glm5_jax.evaluate.isolation import SandboxUnavailableError
from glm5_jax.evaluate.suites import Suite, load_suite
from glm5_jax.model.config import ConfigError
from glm5_jax.quant.formats import QuantizationError

logger = logging.getLogger("glm5_jax.evaluate")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m glm5_jax.evaluate",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.split("\n\n")[1:]),
    )
    model = parser.add_argument_group("the model")
    model.add_argument(
        "--checkpoint",
        help="a train.py run directory, an HF checkpoint directory, or a model "
        "config file (configs/*.py: a randomly initialised model of that "
        "architecture, the untrained baseline; needs --tokenizer)",
    )
    model.add_argument("--tokenizer", help="tokenizer.json for a config-file --checkpoint")
    model.add_argument(
        "--init-seed", type=int, default=0, help="init_params seed for a config-file --checkpoint"
    )
    model.add_argument(
        "--quantize",
        help="quantization recipe: a name in configs/quant/ (int8, fp8, mixed, "
        "nvfp4) or a recipe file (glm5_jax.train.runs.load_any)",
    )
    model.add_argument(
        "--server",
        help="evaluate a running server at this URL instead (OpenAI completions API "
        "with echo + logprobs and /tokenize, e.g. serve.py)",
    )
    model.add_argument("--server-model", help="model id to ask the server for (default: its first)")
    model.add_argument(
        "--api-key",
        default=os.environ.get("GLM5_API_KEY"),
        help="the server's API key (default: $GLM5_API_KEY)",
    )
    add_execution_flags(parser)
    run = parser.add_argument_group("the run")
    run.add_argument("--suite", help="a suite name (configs/eval/<name>.py) or a suite file path")
    run.add_argument("--limit", type=int, help="evaluate at most N items of every task (a quick look)")
    run.add_argument(
        "--output", help="directory for the results (default: eval_results/<label>-<suite>-<time>)"
    )
    run.add_argument("--label", help="this run's name in reports and comparisons (default: from the model)")
    run.add_argument("--no-progress", action="store_true", help="no progress bars")
    run.add_argument(
        "--allow-unsandboxed",
        action="store_true",
        help="run code tasks even where the bubblewrap sandbox cannot work (no user namespaces): "
        "model-written programs then run with this process's uid and files, under resource limits "
        "only (suite field sandbox.allow_unsandboxed)",
    )
    run.add_argument(
        "--compilation-cache",
        metavar="DIR",
        help="keep compiled XLA programs in DIR (JAX's persistent cache): a later run of the "
        "same model shapes (another checkpoint of the run, the untrained model) loads them",
    )
    run.add_argument(
        "--compare",
        nargs="+",
        metavar="RESULTS_JSON",
        help="compare two or more results.json files side by side (no model is loaded)",
    )
    args = parser.parse_args(argv)
    if args.compare:
        if len(args.compare) < 2:
            parser.error("--compare needs at least two results.json files")
    elif not args.suite:
        parser.error("--suite is required (or --compare)")
    elif not (args.checkpoint or args.server):
        parser.error("give --checkpoint (in-process) or --server URL")
    elif args.checkpoint and args.checkpoint.endswith(".py") and not args.tokenizer and not args.server:
        parser.error("a config-file --checkpoint needs --tokenizer (a tokenizer.json)")
    return args


def default_label(args: argparse.Namespace) -> str:
    if args.label:
        return args.label
    if args.server and not args.checkpoint:
        return args.server_model or "server"
    path = Path(args.checkpoint)
    name = f"{path.stem}-init{args.init_seed}" if path.suffix == ".py" else path.resolve().name
    return f"{name}-{Path(args.quantize).stem}" if args.quantize else name


def build_backend(args: argparse.Namespace, suite: Suite):
    """The backend the flags ask for (loading the model, for the in-process one)."""
    if args.server:
        from glm5_jax.evaluate.server import ServerBackend

        return ServerBackend(
            args.server,
            model=args.server_model,
            api_key=args.api_key,
            max_length=suite.max_length,
            batch_size=2 * suite.batch_size,
            concurrency=suite.engine.max_slots,
        )
    from glm5_jax.evaluate.inprocess import InProcessBackend

    common = dict(
        max_length=suite.max_length,
        batch_size=suite.batch_size,
        engine=suite.engine,
        seed=suite.seed,
        description={"checkpoint": args.checkpoint},
    )
    if args.checkpoint.endswith(".py"):
        backend = InProcessBackend.from_config_file(
            args.checkpoint, args.tokenizer, args.init_seed, args.quantize, **common
        )
    else:
        backend = InProcessBackend.from_checkpoint(args.checkpoint, args.quantize, **common)
    backend.options = execution_from_flags(args, backend.options)
    return backend


def build_judge(suite: Suite):
    if not suite.judge:
        return None
    from glm5_jax.evaluate.server import ServerBackend

    key = os.environ.get(suite.judge.get("api_key_env") or "", None)
    return ServerBackend(suite.judge["url"], model=suite.judge.get("model"), api_key=key)


def evaluate(args: argparse.Namespace) -> dict:
    """Runs the suite; returns the paths written."""
    from glm5_jax.evaluate import sandbox
    from glm5_jax.evaluate.tasks import prepare, run_suite

    suite = load_suite(args.suite).limited(args.limit)
    if args.allow_unsandboxed:
        limits = dataclasses.replace(suite.sandbox, allow_unsandboxed=True)
        suite = dataclasses.replace(suite, sandbox=limits)
    if any(t.kind == "code" for t in suite.tasks):
        sandbox.require_isolation(suite.sandbox)  # before any data or model is loaded
    label = default_label(args)
    started, start = datetime.datetime.now(datetime.UTC), time.perf_counter()
    output = Path(args.output or f"eval_results/{label}-{suite.name}-{started:%Y%m%dT%H%M%S}")
    logger.info("suite %s (%d tasks) on %s -> %s", suite.name, len(suite.tasks), label, output)
    prepared = prepare(suite)  # bad data stops the run before the model is loaded
    backend = build_backend(args, suite)
    judge = build_judge(suite)
    try:
        results = run_suite(suite, backend, progress=not args.no_progress, judge=judge, prepared=prepared)
        description = backend.describe()
    finally:
        backend.close()
        if judge is not None:
            judge.close()
    model = {
        "checkpoint": args.checkpoint,
        "server": args.server,
        "quantize": args.quantize,
        "content_hash": report.content_hash(args.checkpoint) if args.checkpoint else None,
        "init_seed": args.init_seed if args.checkpoint and args.checkpoint.endswith(".py") else None,
        "backend": description,
    }
    document = report.results_document(
        suite, results, model, started, time.perf_counter() - start, label, sandbox.features()
    )
    return report.write_run(output, document, results)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("absl").setLevel(logging.ERROR)  # orbax narrates read-only checkpoint access
    for noisy in ("httpx", "jax", "orbax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if args.compilation_cache:
        from glm5_jax.compile_cache import enable_compilation_cache

        enable_compilation_cache(args.compilation_cache)
    try:
        if args.compare:
            paths = report.write_comparison(args.compare, Path(args.output or "eval_results/compare"))
        else:
            paths = evaluate(args)
    except (
        ConfigError,
        TaskDataError,
        QuantizationError,
        CheckpointError,
        ServerError,
        SandboxUnavailableError,
        FileNotFoundError,
    ) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(paths["report"].read_text())
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0
