"""JAX's persistent compilation cache for the entry points (serve.py, train.py): one default
directory, one flag pair, one place that turns it on.

A compiled XLA program is written to the cache directory keyed by its HLO, the devices and the
compiler flags; a later process that compiles the same program (the same model, shapes and
options) loads it instead. serve.py compiles every step shape before it serves, so a restart of
the same server is ready in seconds instead of minutes (docs/serving.md, "Fast restarts").

JAX's cache still traces and lowers every program before it can look it up; serving's step
programs skip that too: the runner keeps them as ahead-of-time compiled executables in a program
store, `programs/` inside the same directory (`program_dir`; glm5_jax/programs.py), which a
restart loads without tracing, lowering or compiling.

Both are trusted: whoever can write to the directory can make the process run their code (JAX's
documentation; a stored program is machine code too), so the default is a per-user directory.

Plain os / argparse at import (no JAX), so that `--help` stays fast; JAX is imported only when the
cache is turned on, which must happen before the process compiles anything (JAX reads the
setting at its first compilation).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

ENV_DIR = "JAX_COMPILATION_CACHE_DIR"  # JAX's own variable: when set, it is the default
ENV_MIN_COMPILE_TIME = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"
# Programs that compiled faster than this are not written (JAX's default is 1 s). 0: every program,
# so that a restart compiles nothing at all; the small ones (slot writes, page copies, weight
# casts) add a few hundred small files, and each load costs less than its compilation.
MIN_COMPILE_SECONDS = 0.0


def default_cache_dir() -> str:
    """$JAX_COMPILATION_CACHE_DIR when the environment sets it, else $XDG_CACHE_HOME/glm5_jax/xla
    (~/.cache/glm5_jax/xla)."""
    if os.environ.get(ENV_DIR):
        return os.environ[ENV_DIR]
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return str(base / "glm5_jax" / "xla")


CACHE_HELP = ("keep compiled XLA programs in DIR (JAX's persistent compilation cache): a later start with "
              "the same model, shapes and options loads them instead of compiling")


def add_compilation_cache_flags(parser: argparse.ArgumentParser) -> None:
    """--compilation-cache-dir DIR (default: default_cache_dir()) and --no-compilation-cache,
    which leaves args.compilation_cache_dir None."""
    parser.add_argument("--compilation-cache-dir", default=default_cache_dir(), metavar="DIR",
                        help=f"{CACHE_HELP} (default: $JAX_COMPILATION_CACHE_DIR, else "
                             "~/.cache/glm5_jax/xla; now %(default)s)")
    parser.add_argument("--no-compilation-cache", dest="compilation_cache_dir", action="store_const",
                        const=None, help="compile everything, read and write no compilation cache")


def enable_compilation_cache(directory: str | None) -> str | None:
    """Turns JAX's persistent compilation cache on in `directory` (None: off, even when the
    environment names one). Call before the first compilation. Returns the directory used."""
    import jax

    if directory is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    directory = os.path.expanduser(directory)
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", directory)
    if ENV_MIN_COMPILE_TIME not in os.environ:  # an explicit setting (the test suite's) wins
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    return directory


class CacheHits:
    """Counts the programs JAX loads from the persistent cache from now on (its cache_hits
    events; JAX's compile events also fire for them, so a compile count alone cannot tell)."""

    EVENT = "/jax/compilation_cache/cache_hits"

    def __init__(self):
        import jax.monitoring

        self.count = 0
        jax.monitoring.register_event_listener(self._on_event)

    def _on_event(self, event: str, **kwargs) -> None:
        if event == self.EVENT:
            self.count += 1


def cache_entries(directory: str | None) -> int:
    """Programs stored in the cache directory (0 when there is none)."""
    if directory is None or not os.path.isdir(directory):
        return 0
    return sum(1 for name in os.listdir(directory) if name.endswith("-cache"))  # not "-atime"


PROGRAMS_SUBDIR = "programs"  # the step programs' store, inside the cache directory
PROGRAM_SUFFIX = ".program"


def program_dir(directory: str | None) -> str | None:
    """The program store's directory for compilation cache `directory` (None: none)."""
    return None if directory is None else os.path.join(os.path.expanduser(directory), PROGRAMS_SUBDIR)


def stored_programs(directory: str | None) -> int:
    """Compiled step programs in the program store of cache `directory` (0 when there is none):
    its "-hlo-" files, one executable each (the other files are keys naming them)."""
    store = program_dir(directory)
    if store is None or not os.path.isdir(store):
        return 0
    return sum(1 for name in os.listdir(store) if "-hlo-" in name and name.endswith(PROGRAM_SUFFIX))
