"""End-to-end tests write ferrollm's caches (the converted tokenizers of GGUF models) to a
temporary folder, never to the user's `~/.cache/ferrollm`."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def ferrollm_cache_root(tmp_path_factory: pytest.TempPathFactory):
    saved = os.environ.get("FERROLLM_CACHE_ROOT")
    os.environ["FERROLLM_CACHE_ROOT"] = str(tmp_path_factory.mktemp("ferrollm-cache"))
    yield
    if saved is None:
        del os.environ["FERROLLM_CACHE_ROOT"]
    else:
        os.environ["FERROLLM_CACHE_ROOT"] = saved
