"""Shared fixtures. Every test runs with the store, state and host pointed at temp paths."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import pytest

from corral.registry.store import Store

if TYPE_CHECKING:
    from corral.server.daemon import Daemon

# Engines created in this process share one ggml, which may read this once: set it
# before any of them, so the tests that ask for batch-invariant kernels
# (EngineConfig(deterministic=True)) get them whatever engine ran first.
os.environ["GGML_CPU_TILED_MM"] = "0"


@pytest.fixture(autouse=True)
def isolated_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No test touches ~: models, data, state, config and caches live under tmp_path."""
    for key in list(os.environ):
        if key.startswith(("CORRAL_", "OLLAMA_")):
            monkeypatch.delenv(key)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("CORRAL_MODELS", str(tmp_path / "models"))
    monkeypatch.setenv("CORRAL_HOST", "127.0.0.1:1")  # nothing listens there
    monkeypatch.setenv("XDG_DATA_HOME", str(home / "data"))
    monkeypatch.setenv("XDG_STATE_HOME", str(home / "state"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / "config"))
    # HOME too: anything that skips XDG (pip, a child's ~/.cache) must not see the user's.
    monkeypatch.setenv("XDG_CACHE_HOME", str(home / "cache"))
    monkeypatch.setenv("HOME", str(home))
    return tmp_path


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "models")


@pytest.fixture(scope="session")
def starter_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    """A store holding both starter models, registered once per session."""
    from corral.registry.starter import install_starters

    root = tmp_path_factory.mktemp("starter") / "models"
    s = Store(root)
    install_starters(s)
    yield s
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def starter_gguf(starter_store: Store) -> Path:
    """The completion starter's GGUF (gemma3:270m-base)."""
    from corral.registry.starter import starter_model_path

    path = starter_model_path(starter_store)
    assert path is not None
    return path


@pytest.fixture(scope="session")
def chat_gguf(starter_store: Store) -> Path:
    """The chat starter's GGUF (smollm2:135m), with a ChatML template in its metadata."""
    from corral.registry.starter import CHAT_NAME, starter_model_path

    path = starter_model_path(starter_store, CHAT_NAME)
    assert path is not None
    return path


@pytest.fixture(scope="module")
def daemon(starter_store: Store, tmp_path_factory: pytest.TempPathFactory) -> Iterator["Daemon"]:
    """One real daemon over the starter store, shared by a module's tests."""
    from tests.support import start_daemon

    d = start_daemon(starter_store, tmp_path_factory.mktemp("daemon"))
    yield d
    d.shutdown()


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[Callable[..., "Daemon"]]:
    """Start daemons with their own settings (`NUM_PARALLEL="1"`, ...); all stop at teardown."""
    from tests.support import start_daemon

    started: list[Daemon] = []

    def make(store: Store | None, root: Path | None = None, capacity: int | None = None,
             **env: str) -> "Daemon":
        d = start_daemon(store, root or tmp_path / f"daemon{len(started)}", capacity, **env)
        started.append(d)
        return d

    yield make
    for d in started:
        d.shutdown()


# Any test that uses one of these fixtures loads the real model through llama.cpp.
MODEL_FIXTURES = frozenset({"starter_store", "starter_gguf", "daemon", "reranker_gguf"})


# Read at collection, before isolated_env clears CORRAL_* for each test.
NETWORK = os.environ.get("CORRAL_TEST_NETWORK") == "1"
NETWORK_SKIP = pytest.mark.skip(reason="needs the package index and cmake; run with "
                                       "CORRAL_TEST_NETWORK=1 .venv/bin/python -m pytest -m network")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark model tests by what they use, so `-m "not model"` can never run one by mistake.

    Tests marked `network` skip unless CORRAL_TEST_NETWORK=1: a plain `pytest -q` needs
    no network, no cmake and no cache of the user's. A skip rather than an addopts `-m`,
    which a user's own `-m` would silently replace."""
    for item in items:
        if MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.model)
        if not NETWORK and item.get_closest_marker("network"):
            item.add_marker(NETWORK_SKIP)


@pytest.fixture(scope="session")
def reranker_gguf(chat_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3-Reranker (tests/rerank_model.py) on the chat starter's vocabulary."""
    from tests.rerank_model import write_reranker

    return write_reranker(chat_gguf, tmp_path_factory.mktemp("reranker") / "reranker.gguf")
