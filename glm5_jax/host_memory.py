"""Host memory policy: keep freed host memory in the process, so each step reuses its pages.

XLA:CPU (and torch on a CPU) take every step's temporaries from malloc. With glibc's defaults,
blocks over the mmap threshold (32 MiB at most) are fresh mappings, threads allocate from arenas
whose heaps are capped at 64 MiB (bigger blocks are mmapped too), and freed heap tops are trimmed;
so every step faults all its big temporaries in again, page by page, from zeroed memory
(docs/benchmarks.md, "Host memory reuse", has the page-fault counts and step times). The cost:
the process keeps its peak host memory until it exits (freed blocks are reused, not returned;
SFT's peak 6.4 GB against 2.9 GB without it, docs/finetuning.md). train.py and serve.py apply it (flags
--reuse_host_memory / --reuse-host-memory); the benchmarks apply it to both sides of a comparison.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

# mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8


def reuse_freed_memory() -> bool:
    """Sets glibc's malloc to serve every block from the main heap (one arena, no mmapped blocks)
    and never trim it, so freed memory is reused by later allocations without page faults.

    Call at program start, before JAX creates its CPU client (threads that have already allocated
    keep their arenas). Returns True when applied; False where the C library is not glibc (the
    policy is glibc-specific; other allocators keep their own defaults).
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    settings = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1))  # -1: never trim
    return all(libc.mallopt(parameter, value) == 1 for parameter, value in settings)
