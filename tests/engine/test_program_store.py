"""The program store (glm5_jax/programs.py): a second process on the same store loads the
engine's step programs (no tracing, no compilation) and generates the same tokens; a program
whose key differs (shapes, static arguments, XLA flags) is compiled instead of loaded, and so is a
stored file that does not load or does not describe the program asked for; after an edit of the
library's source the program is traced and lowered again, and loaded by its lowered module."""

import functools
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import programs
from glm5_jax.compile_cache import PROGRAM_SUFFIX
from glm5_jax.engine.engine import Engine
from glm5_jax.engine.runner import ModelRunner
from glm5_jax.engine.types import SamplingParams
from glm5_jax.programs import ProgramStore

pytestmark = pytest.mark.xdist_group("engine")

ROOT = Path(__file__).resolve().parents[2]
STEP_PROGRAMS = ("decode_loop", "_mixed_step", "_read_slot", "_write_slot")


def generate(store_dir: str) -> dict:
    """A greedy request on the tiny model, its step programs from a fresh ProgramStore(store_dir):
    the tokens, the programs loaded / compiled, and the step programs JAX traced meanwhile."""
    from reference import perturbed_params
    from streams import run_together

    from glm5_jax.config_files import load_model_config

    config = load_model_config(ROOT / "configs" / "tiny.py").replace(num_mtp_layers=0, eos_token_ids=[255])
    store = ProgramStore(store_dir)
    traced = []

    class Traces(logging.Handler):
        def emit(self, record):
            message = record.getMessage()
            if message.startswith("Finished tracing "):
                traced.append(message.split()[2])

    handler = Traces()
    logging.getLogger("jax").addHandler(handler)
    jax.config.update("jax_log_compiles", True)
    factory = functools.partial(ModelRunner, programs=store)
    engine = Engine(config, perturbed_params(config, 5), None, max_slots=2, max_context=32, seed=0,
                    token_budget=16, runner_factory=factory)
    try:
        engine.runner.write_slot(1, engine.runner.read_slot(1))  # the slot copies' programs too
        greedy = SamplingParams(max_tokens=6, temperature=0.0)
        events = run_together(engine, [([3, 1, 4, 1, 5, 9, 2, 6], greedy)])
    finally:
        engine.shutdown()
        jax.config.update("jax_log_compiles", False)
        logging.getLogger("jax").removeHandler(handler)
    return {"tokens": [e.token_id for e in events[0] if e.token_id is not None], "loaded": store.loaded,
            "compiled": store.compiled_count, "traced": sorted(set(traced) & set(STEP_PROGRAMS))}


def _generate_in_a_process(store_dir: str) -> dict:
    """`generate` in a new Python process (a server start), with this process's JAX settings
    that conftest made (they are part of the key: the matmul precision changes the program)."""
    paths = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "engine"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    child = subprocess.run(
        [sys.executable, "-c", "import json, sys, jax; from test_program_store import generate; "
                               "jax.config.update('jax_default_matmul_precision', sys.argv[2]); "
                               "print('RESULT', json.dumps(generate(sys.argv[1])))", store_dir,
         jax.config.jax_default_matmul_precision],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert child.returncode == 0, child.stderr[-4000:]
    return json.loads(next(line for line in child.stdout.splitlines() if line.startswith("RESULT "))[7:])


def test_a_restart_loads_the_step_programs_and_generates_the_same(tmp_path):
    # Both starts are processes of their own: a program is stored when first compiled in a
    # process (one that has run cannot be serialized, and this process may have run these).
    store_dir = str(tmp_path / "programs")
    first = _generate_in_a_process(store_dir)
    assert first["loaded"] == 0 and first["compiled"] >= 4  # mixed step, decode, slot read and write
    assert len(list(Path(store_dir).glob(f"*-hlo-*{PROGRAM_SUFFIX}"))) == first["compiled"]
    second = _generate_in_a_process(store_dir)
    assert second["tokens"] == first["tokens"]
    assert second["compiled"] == 0 and second["loaded"] == first["compiled"]
    assert second["traced"] == []  # loaded: never traced, lowered or compiled


@functools.partial(jax.jit, static_argnames=("scale",), donate_argnames=("state",))
def _toy(weights, state, inputs, *, scale):
    return weights @ inputs * scale, state + 1


def _compile(store, rows=4, scale=2):
    args = (jnp.ones((3, rows)), jnp.zeros(2), np.ones(rows, np.float32))
    return store.compiled("toy", _toy, (), args, {"scale": scale}), args


def test_a_different_key_compiles_instead_of_loading(tmp_path, monkeypatch):
    directory = str(tmp_path / "programs")
    program, args = _compile(ProgramStore(directory))
    expected = np.asarray(program(*args)[0])

    again = ProgramStore(directory)  # a restart: same key
    program, args = _compile(again)
    assert (again.loaded, again.compiled_count) == (1, 0)
    np.testing.assert_array_equal(program(*args)[0], expected)

    for change in ({"rows": 5}, {"scale": 3}):  # other input shapes, other static arguments
        other = ProgramStore(directory)
        _compile(other, **change)
        assert (other.loaded, other.compiled_count) == (0, 1), change

    programs._environment.cache_clear()  # other XLA flags: another environment
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_fast_math=false")
    other = ProgramStore(directory)
    _compile(other)
    assert (other.loaded, other.compiled_count) == (0, 1)
    monkeypatch.undo()
    programs._environment.cache_clear()

    programs.source_fingerprint.cache_clear()  # an edit of the library: another source fingerprint
    monkeypatch.setattr(programs, "_SOURCE_ROOTS", ("glm5_jax/engine",))
    programs._environment.cache_clear()
    other = ProgramStore(directory)
    program, args = _compile(other)  # traced and lowered again: the same module, loaded
    assert (other.loaded, other.relowered, other.compiled_count) == (1, 1, 0)
    np.testing.assert_array_equal(program(*args)[0], expected)
    again = ProgramStore(directory)  # and from now on by the new key, without lowering
    _compile(again)
    assert (again.loaded, again.relowered, again.compiled_count) == (1, 0, 0)
    monkeypatch.undo()
    programs.source_fingerprint.cache_clear()
    programs._environment.cache_clear()


def test_a_stored_file_that_does_not_match_or_load_is_compiled(tmp_path):
    directory = tmp_path / "programs"
    _compile(ProgramStore(str(directory)))
    (stored,) = directory.glob(f"toy-[!h]*{PROGRAM_SUFFIX}")  # the key file (not the module's)
    stored.rename(_other_key_path(directory))  # another program's key, this program's file
    other = ProgramStore(str(directory))
    _compile(other, rows=5)  # finds a file under its key, whose description is not its own
    assert (other.loaded, other.compiled_count) == (0, 1)

    for path in directory.glob(f"*{PROGRAM_SUFFIX}"):
        path.write_bytes(b"not a program")
    broken = ProgramStore(str(directory))
    program, args = _compile(broken)
    assert (broken.loaded, broken.compiled_count) == (0, 1)
    assert np.asarray(program(*args)[0]).shape == (3,)


def _other_key_path(directory: Path) -> Path:
    """Where ProgramStore would look for the toy program with rows=5."""
    import hashlib

    args = (jnp.ones((3, 5)), jnp.zeros(2), np.ones(5, np.float32))
    description = programs.describe("toy", _toy, (), args, {"scale": 2}, None)
    return directory / f"toy-{hashlib.sha256(description.encode()).hexdigest()}{PROGRAM_SUFFIX}"


def _scaled_sum(factor: float, shift):
    """A jitted closure, as the training loop's steps are: `factor` and `shift` are baked in."""
    return jax.jit(lambda x: jnp.sum(x) * factor + shift)


def test_a_closures_captured_values_are_part_of_its_key(tmp_path):
    """StoredFunction: a closure over other values (a learning rate, a constant array) is another
    program, even under the same name and input shapes; the same values load the stored one
    and the counts say so."""
    directory = str(tmp_path / "programs")
    x = jnp.arange(4.0)
    shift = jnp.ones(())

    def stored(factor, shift, store):
        return programs.StoredFunction("scaled", _scaled_sum(factor, shift), (factor, shift), store=store)

    first = stored(2.0, shift, ProgramStore(directory))
    assert float(first(x)) == 13.0 and (first.loaded, first.compiled) == (0, 1)
    again = stored(2.0, shift, ProgramStore(directory))  # a restart: loaded, same result
    assert float(again(x)) == 13.0 and (again.loaded, again.compiled) == (1, 0)
    for factor, other_shift, expected in ((3.0, shift, 19.0), (2.0, shift * 5, 17.0)):
        other = stored(factor, other_shift, ProgramStore(directory))
        assert float(other(x)) == expected and other.compiled == 1, (factor, other_shift)
    assert float(again(jnp.arange(6.0))) == 31.0 and again.compiled == 1  # a new shape: one more
