"""glm5_jax.host_memory: freed host memory is reused without page faults (glibc)."""

import platform
import subprocess
import sys

import pytest

from glm5_jax import host_memory

# Mallocs, writes and frees 128 MB three times in a worker thread (as XLA:CPU's threads do; plain
# malloc, since numpy asks for huge pages) and prints the minor page faults of the last two
# rounds. The module is loaded alone: importing the package would import JAX first.
PROBE = """
import ctypes, ctypes.util, importlib.util, resource, sys, threading
spec = importlib.util.spec_from_file_location("host_memory", sys.argv[2])
host_memory = importlib.util.module_from_spec(spec); spec.loader.exec_module(host_memory)
applied = host_memory.reuse_freed_memory() if sys.argv[1] == "reuse" else None
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
size = 128 << 20
faults = []
def rounds():
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        block = libc.malloc(size)
        ctypes.memset(block, 1, size)
        libc.free(block)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
worker = threading.Thread(target=rounds)
worker.start(); worker.join()
print(applied, sum(faults[1:]))
"""


def faults_after_first_round(mode: str) -> tuple[str, int]:
    result = subprocess.run([sys.executable, "-c", PROBE, mode, host_memory.__file__],
                            capture_output=True, text=True, check=True)
    applied, faults = result.stdout.split()
    return applied, int(faults)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the policy is glibc's")
def test_reuse_freed_memory_stops_page_faults_on_reallocation():
    _, default_faults = faults_after_first_round("default")
    applied, reuse_faults = faults_after_first_round("reuse")
    assert applied == "True"
    # 128 MB is 32K pages; by default each round faults them all in again.
    assert default_faults > 50_000, default_faults
    assert reuse_faults < 2_000, reuse_faults
