"""Shared fixtures of the serving tests: the app over a module's `engine` fixture (a FakeEngine or
a real Engine, defined by each module), its URL and an official `openai` client on it. A module
names its served model with a MODEL constant (default "glm5-test")."""

import openai
import pytest
from fake_engine import running

from glm5_jax.api.app import create_app


@pytest.fixture(scope="module")
def base_url(request, engine):
    with running(create_app(engine, getattr(request.module, "MODEL", "glm5-test"))) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=20) as c:
        yield c
