"""Ahead-of-time compiled device programs: one `jax.stages.Compiled` per program and shape, kept in
memory and on disk, so that a restart loads its programs instead of tracing, lowering and
compiling them again: the serving runner's step programs (engine/runner.py) and the training
loop's train, evaluation and initialisation steps (train/loop.py, through `StoredFunction`).

Why: a call through `jax.jit` traces and lowers its function for every new shape before JAX can
even compute the key of its persistent compilation cache. On the demo model a warm start spent
about 6 s tracing and 5 s lowering programs it then loaded from that cache (docs/serving.md, "Fast
restarts"). Here each program is compiled once (`jax.jit(f).lower(...).compile()`), the runner
dispatches through the Compiled object (no static arguments to hash, no retracing when an input
comes back from a step with another committedness), and the executable is written serialized
(`jax.experimental.serialize_executable`) to the store directory. A later process that asks for
the same program under the same key loads it: no tracing, no lowering, no compilation.

The key is a SHA-256 over everything that makes the program (`describe`): its name and
function, what a jitted closure captured (named by its caller: configs, settings, constant
arrays by a hash of their bytes), the static arguments (model config, execution options, shapes
such as steps), every input's shape, dtype, weak type and sharding (device ids included), the
source of glm5_jax and kernels_pallas (any edit changes every key), the jax and jaxlib
versions, the backend, its version and device kinds, the process's place in a multi-process
job, the mesh, XLA_FLAGS / LIBTPU_INIT_ARGS and JAX's configuration (less its cache and logging
settings). The file keeps the whole description too: it is used only when that matches exactly.

On a miss the program is traced and lowered, and looked up a second time by its lowered module
(`hlo-` files: the StableHLO text without locations, its input and output trees, the same
environment less the source): an edit that leaves the program as it was (most edits of host
code) costs tracing and lowering, as JAX's cache did, but no compilation; the key of the first
kind then names that file. Anything else (no match, a file that fails to load) compiles, and
stores the result under both keys.

A program for the store is compiled afresh (`_fresh_compile`) and serialized before it first
runs: on XLA:CPU (jax 0.10.2) an executable that JAX loaded from its persistent cache serializes
into one that fails at its first call ("Function ... not found"), and one that has run does not
serialize at all ("`LessThan` is not serializable": its sort comparators were replaced).

Trust: a stored program is machine code, as JAX's compilation cache entries are: whoever can
write to the directory can make the process run their code (the directory lives inside the
compilation cache's, `default_directory`; the same rules apply).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import pickle
import tempfile
import threading
from pathlib import Path

import jax
import numpy as np

from glm5_jax.compile_cache import PROGRAM_SUFFIX, program_dir

logger = logging.getLogger(__name__)

FORMAT = 1  # of the stored files; part of the key
# JAX settings that do not change a program (where things are cached or logged).
_IGNORED_CONFIG_PREFIXES = (
    "jax_compilation_cache", "jax_persistent_cache", "jax_raise_persistent_cache", "jax_log",
    "jax_explain_cache", "jax_debug_log", "jax_dump", "jax_pprint", "jax_traceback",
    "jax_tracer_error", "jax_include_full_tracebacks", "jax_source_url", "jax_captured_constants",
    "jax_cross_host", "jax_distributed_debug", "jax_cpu_get_", "jax_check_proxy_envs",
    "jax_transfer_guard", "jax_thread_guard", "jax_share_binary_between_hosts")
_SOURCE_ROOTS = ("glm5_jax", "kernels_pallas")


def default_directory() -> str | None:
    """`programs/` inside JAX's persistent compilation cache directory when that cache is on
    (serve.py: --compilation-cache-dir), else None (programs kept in memory only)."""
    if not jax.config.jax_enable_compilation_cache:
        return None
    directory = jax.config.jax_compilation_cache_dir
    if not directory or "://" in directory:  # a remote cache (gs://...): no program store
        return None
    return program_dir(directory)


@functools.cache
def source_fingerprint() -> str:
    """SHA-256 of the library's Python source (glm5_jax/, kernels_pallas/): file names and contents."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for top in _SOURCE_ROOTS:
        for path in sorted((root / top).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


@functools.cache
def _environment(with_source: bool = True) -> str:
    """What the process's JAX is and runs on (the part of the key every program shares), and
    (with_source) which library source traced it."""
    import jaxlib

    devices = jax.devices()
    config = {name: value for name, value in sorted(jax.config.values.items())
              if not name.startswith(_IGNORED_CONFIG_PREFIXES)}
    return repr({
        "format": FORMAT, "source": source_fingerprint() if with_source else None,
        "jax": jax.__version__, "jaxlib": jaxlib.__version__,
        "backend": (devices[0].platform, devices[0].client.platform_version),
        "devices": [(device.id, device.device_kind, device.process_index) for device in devices],
        "process": (jax.process_index(), jax.process_count()),
        "env": {name: os.environ.get(name) for name in ("XLA_FLAGS", "LIBTPU_INIT_ARGS")},
        "config": config})


def _leaf(value) -> str:
    """One input: shape, dtype, weak type and where it lives."""
    aval = jax.typeof(value)
    sharding = getattr(value, "sharding", None)
    if sharding is None:
        placed = "host"
    else:
        placed = f"{sharding!r}@{_device_ids(sharding)}"
    return f"{aval.str_short()}{'~weak' if aval.weak_type else ''}:{placed}"


def _device_ids(sharding) -> list[int]:
    """The ids of a sharding's devices in the program's order (its device assignment; the
    sorted set where a jax has no such attribute)."""
    devices = getattr(sharding, "_device_assignment", None)
    if devices is None:
        devices = sorted(sharding.device_set, key=lambda device: device.id)
    return [device.id for device in devices]


def _captured(value) -> str:
    """What a closure captured, for the key: arrays by shape, dtype and a hash of their bytes,
    anything else by its repr (a dataclass config names all its fields)."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        data = np.asarray(value)
        return f"array {data.dtype}{list(data.shape)} {hashlib.sha256(data.tobytes()).hexdigest()}"
    return repr(value)


def describe(name: str, function, static_args: tuple, args: tuple, static_kwargs: dict, mesh,
             captured: tuple = ()) -> str:
    """Everything that makes the program `function(*static_args, *args, **static_kwargs)`;
    captured: what `function` closed over (its name says nothing of that)."""
    leaves, tree = jax.tree.flatten(args)
    return "\n".join((
        f"program {name}: {function.__module__}.{getattr(function, '__qualname__', function)}",
        f"static {static_args!r} {sorted(static_kwargs.items())!r}",
        f"captured {[_captured(value) for value in captured]}",
        f"mesh {mesh!r} {None if mesh is None else mesh.device_ids.tolist()}",
        f"inputs {tree}", *map(_leaf, leaves), _environment()))


def describe_lowered(name: str, lowered: jax.stages.Lowered) -> str:
    """The second key's description: the lowered module (hashed), its trees, the environment."""
    module = hashlib.sha256(lowered.as_text(debug_info=False).encode()).hexdigest()
    return "\n".join((f"program {name}: module {module}", f"in {lowered.in_tree}", f"out {lowered.out_tree}",
                      _environment(with_source=False)))


class ProgramStore:
    """Compiled programs by key, in memory and (directory given) on disk. `compiled` returns the
    program, loading or compiling it; `loaded` (from disk), `relowered` (of those, found by
    their lowered module) and `compiled_count` count what this store did."""

    def __init__(self, directory: str | None):
        self.directory = directory
        self._programs: dict[str, jax.stages.Compiled] = {}
        self._lock = threading.Lock()
        self.loaded = self.relowered = self.compiled_count = 0

    def compiled(self, name: str, function, static_args: tuple, args: tuple, static_kwargs: dict,
                 mesh=None, captured: tuple = ()) -> jax.stages.Compiled:
        """The program `function` (a jax.jit function) for these arguments, called as
        `program(*args)`. static_args: leading positional static arguments (the model config);
        static_kwargs: the keyword static arguments; captured: everything a jitted closure
        closed over that shapes its program (configs, settings, constant arrays). Call it in the
        context the program is traced in (the runner's mesh rules)."""
        try:
            description = describe(name, function, static_args, args, static_kwargs, mesh, captured)
        except Exception as exc:  # noqa: BLE001 - a jax this cannot describe: compile, store nothing
            logger.warning("program %s cannot be keyed (%s: %s): compiled, not stored", name,
                           type(exc).__name__, exc)
            self.compiled_count += 1
            return function.lower(*static_args, *args, **static_kwargs).compile()
        key = hashlib.sha256(description.encode()).hexdigest()
        with self._lock:
            program = self._programs.get(key)
            if program is None:
                program = self._load(f"{name}-{key}", description)
                if program is None:
                    program = self._lower_and_compile(name, f"{name}-{key}", description,
                                                      function.lower(*static_args, *args, **static_kwargs))
                self._programs[key] = program
        return program

    def _lower_and_compile(self, name: str, stem: str, description: str, lowered) -> jax.stages.Compiled:
        """The lowered program, loaded by its module's key or compiled; both keys then name it."""
        if self.directory is None:
            self.compiled_count += 1
            return lowered.compile()
        try:
            module_description = describe_lowered(name, lowered)
        except Exception as exc:  # noqa: BLE001 - a jax this cannot describe: compile, store nothing
            logger.warning("program %s cannot be keyed (%s: %s): compiled, not stored", name,
                           type(exc).__name__, exc)
            self.compiled_count += 1
            return lowered.compile()
        module_stem = f"{name}-hlo-{hashlib.sha256(module_description.encode()).hexdigest()}"
        program = self._load(module_stem, module_description)
        if program is not None:
            self.relowered += 1
        else:
            program, fresh = _fresh_compile(lowered)
            self.compiled_count += 1
            if not fresh or not self._save(module_stem, module_description, program):
                return program
        self._write(stem, {"description": description, "same_as": module_stem})
        return program

    def _path(self, stem: str) -> Path:
        return Path(self.directory) / f"{stem}{PROGRAM_SUFFIX}"

    def _load(self, stem: str, description: str) -> jax.stages.Compiled | None:
        """The stored program `stem` if its description is `description` (a key file naming a
        module file is followed), else None."""
        if self.directory is None:
            return None
        try:
            payload = self._path(stem).read_bytes()
        except OSError:
            return None
        try:
            from jax.experimental.serialize_executable import deserialize_and_load

            stored = pickle.loads(payload)  # trusted: see the module docs
            if stored["description"] != description:  # a hash collision, or a foreign file
                return None
            if "same_as" in stored:
                stored = pickle.loads(self._path(stored["same_as"]).read_bytes())
            devices = {device.id: device for device in jax.devices()}
            program = deserialize_and_load(stored["executable"], stored["in_tree"], stored["out_tree"],
                                           execution_devices=[devices[i] for i in stored["devices"]])
        except Exception as exc:  # noqa: BLE001 - any failure to load means: compile it
            logger.warning("stored program %s did not load (%s: %s); compiling it", stem,
                           type(exc).__name__, exc)
            return None
        self.loaded += 1
        return program

    def _save(self, stem: str, description: str, program: jax.stages.Compiled) -> bool:
        try:
            from jax.experimental.serialize_executable import serialize

            executable, in_tree, out_tree = serialize(program)
            # Where it runs: its first input's devices, or its first output's (an initialiser
            # takes no input).
            devices = _device_ids((jax.tree.leaves(program.input_shardings)
                                   or jax.tree.leaves(program.output_shardings))[0])
        except Exception as exc:  # noqa: BLE001 - not stored: the next start compiles it again
            logger.warning("program %s cannot be stored (%s: %s)", stem, type(exc).__name__, exc)
            return False
        return self._write(stem, {"description": description, "executable": executable, "in_tree": in_tree,
                                  "out_tree": out_tree, "devices": devices})

    def _write(self, stem: str, stored: dict) -> bool:
        try:
            os.makedirs(self.directory, exist_ok=True)
            # Written whole under a temporary name, then renamed: a reader never sees half a file.
            prefix = f".{stem[:40]}-"
            with tempfile.NamedTemporaryFile(dir=self.directory, prefix=prefix, delete=False) as out:
                out.write(pickle.dumps(stored, protocol=pickle.HIGHEST_PROTOCOL))
            os.replace(out.name, self._path(stem))
        except OSError as exc:
            logger.warning("program %s was not stored (%s)", stem, exc)
            return False
        return True


def _fresh_compile(lowered: jax.stages.Lowered) -> tuple[jax.stages.Compiled, bool]:
    """(lowered compiled, whether XLA compiled it here), past JAX's caches: neither one loaded
    from its persistent cache nor one its in-memory cache holds (which may have run) survives
    serialization (module docs). Compiler options (a debug option at its default value) make
    JAX compile anew; its persistent cache is used or not as JAX decided once per process
    (compilation_cache._cache_used, a private flag, cleared here for the duration); where that
    flag is missing (another jax), a cache hit is still seen by its event, and the program is
    then not stored."""
    from jax._src import compilation_cache

    decide = getattr(compilation_cache, "is_cache_used", None)
    if decide is not None:
        decide(jax.devices()[0].client)  # JAX makes its decision now (then cleared below)
    used = getattr(compilation_cache, "_cache_used", None)
    hits_before = _CACHE_HITS.count()
    with contextlib.ExitStack() as restore:
        if used is not None:
            compilation_cache._cache_used = False
            restore.callback(setattr, compilation_cache, "_cache_used", used)
        program = lowered.compile(compiler_options={"xla_embed_ir_in_executable": False})
    return program, _CACHE_HITS.count() == hits_before


class _ThreadCacheHits:
    """JAX persistent-cache hits per thread (the compiling thread's own count)."""

    def __init__(self):
        self._local = threading.local()
        self._registered = False
        self._lock = threading.Lock()

    def count(self) -> int:
        with self._lock:
            if not self._registered:
                jax.monitoring.register_event_listener(self._on_event)
                self._registered = True
        return getattr(self._local, "hits", 0)

    def _on_event(self, event: str, **kwargs) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            self._local.hits = getattr(self._local, "hits", 0) + 1


_CACHE_HITS = _ThreadCacheHits()


class StoredFunction:
    """`jitted(*args)` through a store's programs, one per input signature (shapes and dtypes):
    a restart loads them instead of tracing, lowering and compiling. For a jitted closure,
    `captured` must name all it closed over that shapes its program (module docs: the key);
    `context` (a callable returning a context manager) is entered around tracing and every call,
    e.g. the mesh's sharding rules. `loaded` / `compiled` count what the store did for it."""

    def __init__(self, name: str, jitted, captured: tuple, *, mesh=None, context=None,
                 store: ProgramStore | None = None):
        self.name, self.jitted, self.captured, self.mesh = name, jitted, captured, mesh
        self.context = context or contextlib.nullcontext
        self.store = store if store is not None else program_store(default_directory())
        self._programs: dict[tuple, jax.stages.Compiled] = {}
        self.loaded = self.compiled = 0

    def __call__(self, *args):
        key = signature(args)
        program = self._programs.get(key)
        with self.context():
            if program is None:
                loaded, compiled = self.store.loaded, self.store.compiled_count
                program = self.store.compiled(self.name, self.jitted, (), args, {}, self.mesh, self.captured)
                self.loaded += self.store.loaded - loaded
                self.compiled += self.store.compiled_count - compiled
                self._programs[key] = program
            return program(*args)


_STORES: dict[str | None, ProgramStore] = {}
_STORES_LOCK = threading.Lock()


def program_store(directory: str | None) -> ProgramStore:
    """The process's store for `directory` (one per directory: runners of the same model share
    its programs, as they shared jit's caches)."""
    with _STORES_LOCK:
        if directory not in _STORES:
            _STORES[directory] = ProgramStore(directory)
        return _STORES[directory]


def signature(args) -> tuple:
    """A cheap per-call key of `args`: their tree structure, shapes and dtypes (what selects a
    compiled shape; a runner's other inputs keep theirs)."""
    leaves, tree = jax.tree.flatten(args)
    return tree, tuple((np.shape(leaf), getattr(leaf, "dtype", type(leaf))) for leaf in leaves)
