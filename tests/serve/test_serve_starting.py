"""serve.py listens while the engine compiles (docs/serving.md, "Fast restarts"): a real Engine whose
warm-up is held at its first step shape (before compiling it: no step compiles here); meanwhile
/health answers 503 "starting" with the progress, completions and chat 503 with Retry-After and the
progress in the message, /v1/models answers; a warm-up that fails makes /health "unavailable"
(serve.py then exits 1). And the wiring of the compilation cache flags (glm5_jax/compile_cache.py),
without compiling anything. The progress of a real warm-up: test_serve_e2e's server start."""

import threading

import httpx
import pytest
from fake_engine import make_tokenizer, running
from reference import perturbed_params

from glm5_jax import compile_cache
from glm5_jax.api.app import create_app
from glm5_jax.engine.engine import Engine

pytestmark = pytest.mark.xdist_group("engine")  # the engine tests' worker: their programs are cached

MODEL = "glm5-test"


def test_starting_until_warm_then_failed_warm_up(tiny_config):
    config = tiny_config.replace(num_mtp_layers=0, eos_token_ids=[255])
    engine = Engine(config, perturbed_params(config, 5), make_tokenizer(), max_slots=3, max_context=48,
                    seed=0, token_budget=16)
    held, release = threading.Event(), threading.Event()

    def hold_first_shape(rows):  # the warm-up's first call, on the engine thread
        held.set()
        release.wait(60)
        raise RuntimeError("warm-up stopped by the test")

    engine.runner.padding_decode = hold_first_shape
    try:
        with running(create_app(engine, MODEL)) as url:
            warmed = engine.warm_up(wait=False)
            assert engine.warming_up  # at once: no moment in which /health says ok before the warm-up
            assert held.wait(60), "the warm-up did not start"
            health = httpx.get(f"{url}/health")
            total = engine.warm_up_total
            assert health.status_code == 503 and health.headers["retry-after"] == "5"
            assert health.json() == {"status": "starting", "progress": {"done": 0, "total": total},
                                     "compile_count": engine.compile_count}
            for path, body in (("completions", {"model": MODEL, "prompt": "hi"}),
                               ("chat/completions", {"model": MODEL, "messages": [{"role": "user",
                                                                                   "content": "hi"}]})):
                reply = httpx.post(f"{url}/v1/{path}", json=body)
                assert reply.status_code == 503 and reply.headers["retry-after"] == "5", path
                error = reply.json()["error"]
                assert error["code"] == "starting" and error["type"] == "server_error"
                assert f"The server is starting: compiling step shapes 0 of {total}" in error["message"]
            assert httpx.get(f"{url}/v1/models").status_code == 200  # no engine needed

            release.set()  # the warm-up now fails: the engine's failure path
            assert warmed.wait(60)
            health = httpx.get(f"{url}/health")
            assert health.status_code == 503 and health.json()["status"] == "unavailable"
            assert "warm-up stopped by the test" in health.json()["reason"]
            reply = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi"})
            assert reply.status_code == 503 and reply.json()["error"]["code"] == "engine_unavailable"
    finally:
        release.set()
        engine.shutdown()


def test_compilation_cache_flags(monkeypatch, tmp_path):
    import serve

    # The suite names its per-run cache in JAX_COMPILATION_CACHE_DIR (tests/conftest.py): it wins.
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "env"))
    assert serve.parse_args([]).compilation_cache_dir == str(tmp_path / "env")
    assert serve.parse_args(["--compilation-cache-dir", "x"]).compilation_cache_dir == "x"
    assert serve.parse_args(["--no-compilation-cache"]).compilation_cache_dir is None
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert serve.parse_args([]).compilation_cache_dir == str(tmp_path / "xdg" / "glm5_jax" / "xla")

    settings = []
    monkeypatch.setattr("jax.config.update", lambda name, value: settings.append((name, value)))
    assert compile_cache.enable_compilation_cache(None) is None
    assert settings == [("jax_enable_compilation_cache", False)]
    settings.clear()
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "2")  # an explicit setting wins
    assert compile_cache.enable_compilation_cache(str(tmp_path / "c")) == str(tmp_path / "c")
    assert settings == [("jax_enable_compilation_cache", True),
                        ("jax_compilation_cache_dir", str(tmp_path / "c"))]
    settings.clear()
    monkeypatch.delenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")
    compile_cache.enable_compilation_cache(str(tmp_path / "c"))
    assert ("jax_persistent_cache_min_compile_time_secs", compile_cache.MIN_COMPILE_SECONDS) in settings
    (tmp_path / "c").mkdir()
    for name in ("jit_f-1234-cache", "jit_f-1234-atime"):
        (tmp_path / "c" / name).touch()
    assert compile_cache.cache_entries(str(tmp_path / "c")) == 1
    assert compile_cache.cache_entries(None) == compile_cache.cache_entries(str(tmp_path / "none")) == 0
