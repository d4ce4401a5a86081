"""Host overhead of the serving engine in steady decode: the host's work per device call and per
model step, and the share of wall time in which no compiled step executes (the device's idle
share), at 1, 32 and 128 running requests (glm5_jax/engine/timing.py says what each phase holds).

    python bench/host_overhead.py --checkpoint runs/demo                      # 1, 32, 128 requests
    python bench/host_overhead.py --checkpoint runs/demo --running 1,32,128 --decode-steps 8,16

The engine runs in this process with `timing=True`; N requests (random prompts, fixed output
lengths: ignore_eos) are consumed by an asyncio loop that detokenises every token
(glm5_jax/engine/textstream.py, as the API does), so the event loop's work competes for the GIL
as it does in serve.py. The steady window is the decode calls in which all N requests run; the
first call of each window (right after the prefill) is left out. A baseline pass with timing off
gives the tokens/s the instrumentation costs nothing against.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

import numpy as np

from glm5_jax.compile_cache import default_cache_dir, enable_compilation_cache
from glm5_jax.engine.engine import Engine
from glm5_jax.engine.textstream import Detokenizer
from glm5_jax.engine.timing import summarize
from glm5_jax.engine.types import SamplingParams
from glm5_jax.train.runs import checkpoint_options, load_any


async def run_requests(engine: Engine, tokenizer, count: int, prompt_len: int, output_len: int,
                       seed: int, detokenize: bool = True):
    rng = np.random.default_rng(seed)
    items = [(rng.integers(10, engine.config.vocab_size - 10, prompt_len).tolist(),
              SamplingParams(max_tokens=output_len, temperature=1.0, seed=seed + i, ignore_eos=True))
             for i in range(count)]
    streams = engine.submit_batch(items)

    async def consume(stream):
        text = Detokenizer(tokenizer, ())
        tokens = 0
        async for event in stream:
            if event.token_id is not None:
                tokens += 1
                if detokenize:
                    text.push(event.token_id)
                    text.take()
        return tokens

    started = time.perf_counter()
    tokens = await asyncio.gather(*(consume(s) for s in streams))
    return sum(tokens), time.perf_counter() - started


def measure(engine: Engine, tokenizer, running: int, prompt_len: int, output_len: int,
            detokenize: bool = True) -> dict:
    engine.timing.clear()
    tokens, seconds = asyncio.run(run_requests(engine, tokenizer, running, prompt_len, output_len, running,
                                               detokenize))
    engine.timing.settle()
    records = engine.timing.snapshot()
    steady = [r for r in records if r.kind == "decode" and r.rows == running]
    summary = summarize(steady[1:])
    summary.update(tokens_per_second=tokens / seconds, wall_s=seconds,
                   mixed_calls=sum(r.kind == "mixed" for r in records),
                   load_average=os.getloadavg()[0])  # 2 shared cores: the figures move with the load
    return summary


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default="runs/demo")
    parser.add_argument("--running", default="1,32,128", help="running requests per measurement")
    parser.add_argument("--decode-steps", default="8", help="decode steps per device call (comma list)")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=160)
    parser.add_argument("--output", default="", help="write the results as JSON here")
    parser.add_argument("--no-detokenize", action="store_true",
                        help="consume the events without detokenising (what the event loop's work costs)")
    parser.add_argument("--timing-only", action="store_true", help="skip the timing-off baseline pass")
    args = parser.parse_args(argv)
    enable_compilation_cache(default_cache_dir())  # a second run loads the step programs
    config, params, tokenizer = load_any(args.checkpoint)
    options = checkpoint_options(args.checkpoint)
    counts = [int(n) for n in args.running.split(",")]
    results = []
    for decode_steps in (int(n) for n in args.decode_steps.split(",")):
        for timing in (True,) if args.timing_only else (False, True):
            engine = Engine(config, params, tokenizer, max_slots=max(counts), token_budget=256,
                            options=options, max_context=args.prompt_len + args.output_len + 8,
                            decode_steps=decode_steps, timing=timing, seed=0)
            started = time.perf_counter()
            engine.warm_up()
            print(f"decode_steps {decode_steps}, timing {'on' if timing else 'off'}: warmed up in "
                  f"{time.perf_counter() - started:.1f} s", flush=True)
            for running in counts:
                result = measure(engine, tokenizer, running, args.prompt_len, args.output_len,
                                 not args.no_detokenize)
                result.update(running=running, decode_steps=decode_steps, timing=timing)
                results.append(result)
                shown = {k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}
                print(json.dumps(shown), flush=True)
            engine.shutdown()
    print()
    print("| decode steps / call | running | tok/s (timing off) | tok/s (on) | host ms / call "
          "| host ms / step | device ms / call | idle share | plan / arrays / dispatch / deliver ms "
          "| fetch wait ms | host CPU ms / call | load average |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for on in (r for r in results if r["timing"]):
        off = next((r for r in results if not r["timing"] and r["running"] == on["running"]
                    and r["decode_steps"] == on["decode_steps"]), {"tokens_per_second": float("nan")})
        print(f"| {on['decode_steps']} | {on['running']} | {off['tokens_per_second']:.0f} | "
              f"{on['tokens_per_second']:.0f} | {on['host_ms_per_call']:.2f} | "
              f"{on['host_ms_per_step']:.3f} | "
              f"{on['device_ms_per_call']:.1f} | {on['idle_share']:.1%} | "
              f"{on['plan_ms_per_call']:.2f} / {on['arrays_ms_per_call']:.2f} / "
              f"{on['dispatch_ms_per_call']:.2f} / {on['deliver_ms_per_call']:.2f} | "
              f"{on['fetch_ms_per_call']:.1f} | {on.get('host_cpu_ms_per_call', float('nan')):.2f} | "
              f"{on['load_average']:.1f} |")
    if args.output:
        with open(args.output, "w") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
