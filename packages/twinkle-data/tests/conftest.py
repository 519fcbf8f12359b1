"""Fixtures shared by twinkle-data's tests."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tokenizers_offline: a test helper module

from twinkle.hub import TEST_MODEL, cache_root


@pytest.fixture(autouse=True)
def _private_encode_cache(tmp_path, monkeypatch):
    """Each test gets its own encode cache, so cache hits are the test's own doing."""
    import twinkle.dataset.cache as cache

    monkeypatch.setattr(cache, "cache_root", lambda: tmp_path / "twinkle-cache")


@pytest.fixture(scope="session")
def tiny_template():
    from twinkle.template import Template

    return Template(model_id=TEST_MODEL)


@pytest.fixture(scope="session")
def qwen_base_json():
    import tokenizers_offline

    return tokenizers_offline.base_tokenizer_json(cache_root() / "test-assets")


@pytest.fixture(scope="session")
def qwen_tokenizer(qwen_base_json):
    import tokenizers_offline

    return tokenizers_offline.make_tokenizer(qwen_base_json, "qwen")


@pytest.fixture(scope="session")
def llama_tokenizer(qwen_base_json):
    import tokenizers_offline

    return tokenizers_offline.make_tokenizer(qwen_base_json, "llama")
