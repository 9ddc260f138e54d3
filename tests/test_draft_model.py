"""Draft models (a Modelfile's DRAFT, registry/draft.py, runner.speculative.draftmodel) on a
real daemon: created from a model name or an uploaded GGUF, loaded in the runner beside
the model, shown in `ps` and `show`, exact, and refused at create time when the
vocabulary is not the model's.

The test GGUF is a tiny random llama on the chat starter's vocabulary whose output norm
makes it sure of one token at each position (benchmarks/gpu_model.py), so it does
propose: nonsense, which verification rejects. The chat starter drafting for itself
proposes what it then picks."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import httpx
import pytest

from corral.registry.gguf import read_vocabulary
from corral.registry.draft import vocabulary_problem
from corral.registry.store import Store, file_sha256
from corral.server.daemon import Daemon
from tests.support import DaemonFactory
from tests.test_cli import corral
from tests.test_speculative import REPETITIVE

CHAT = "smollm2:135m"
BASE = "gemma3:270m-base"
N = 48


@pytest.fixture(scope="module")
def draft_gguf(chat_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from benchmarks.gpu_model import SIZES, write_model

    path = tmp_path_factory.mktemp("draft") / "draft.gguf"
    write_model(chat_gguf, path, SIZES["tiny"], seed=3, sure=100.0)
    return path


def test_the_vocabulary_rule(chat_gguf: Path, starter_gguf: Path, draft_gguf: Path) -> None:
    chat = read_vocabulary(chat_gguf)
    assert len(chat.tokens) == 49152 and chat.tokens[1] == b"<|im_start|>"
    assert vocabulary_problem(chat, read_vocabulary(draft_gguf)) is None
    assert vocabulary_problem(chat, chat) is None
    gemma = read_vocabulary(starter_gguf)
    assert "tokenizer" in (vocabulary_problem(chat, gemma) or "")
    tokens = list(chat.tokens)
    tokens[4] = b"first ids may differ"  # control tokens below 5 are not compared
    assert vocabulary_problem(chat, dataclasses.replace(chat, tokens=tokens)) is None
    tokens[300] = b"changed"
    assert "token 300" in (vocabulary_problem(chat, dataclasses.replace(chat, tokens=tokens))
                           or "")
    padded = dataclasses.replace(chat, tokens=chat.tokens + [b"<pad>"] * 128)
    assert vocabulary_problem(chat, padded) is None
    padded = dataclasses.replace(chat, tokens=chat.tokens + [b"<pad>"] * 129)
    assert "49281 tokens" in (vocabulary_problem(chat, padded) or "")
    bos = vocabulary_problem(chat, dataclasses.replace(chat, add_bos=True))
    assert bos == "it adds a BOS token and the model does not"
    assert vocabulary_problem(chat, dataclasses.replace(chat, add_bos=None)) is None  # unsaid
    eos = dataclasses.replace(chat, eos=7, add_eos=True)
    assert "EOS" in (vocabulary_problem(dataclasses.replace(chat, add_eos=True), eos) or "")


def generate(daemon: Daemon, model: str) -> dict:
    r = httpx.post(f"{daemon.url}/api/generate", timeout=600, json={
        "model": model, "prompt": REPETITIVE, "raw": True, "stream": False,
        "options": {"temperature": 0, "seed": 1, "num_predict": N}})
    assert r.status_code == 200, r.text
    return r.json()


def create(daemon: Daemon, body: dict) -> httpx.Response:
    return httpx.post(f"{daemon.url}/api/create", json={"stream": False, **body}, timeout=300)


def test_a_draft_model_drafts_exactly_and_shows(daemon_factory: DaemonFactory,
                                                starter_store: Store, draft_gguf: Path) -> None:
    # Batch-invariant kernels: the drafts' batch shapes then change no bit of the output,
    # so the drafted answers must be the plain model's exactly.
    daemon = daemon_factory(starter_store, NUM_PARALLEL="1", DETERMINISTIC="1",
                            MAX_LOADED_MODELS="1")
    digest = file_sha256(draft_gguf)
    with draft_gguf.open("rb") as f:
        assert httpx.post(f"{daemon.url}/api/blobs/{digest}", content=f.read(),
                          timeout=60).status_code == 201
    r = create(daemon, {"model": "smol-random", "from": CHAT,
                        "draft_files": {"draft.gguf": digest}})
    assert r.status_code == 200 and r.json()["status"] == "success", r.text
    assert create(daemon, {"model": "smol-self", "from": CHAT, "draft": CHAT}).status_code == 200

    plain = generate(daemon, CHAT)
    drafted = generate(daemon, "smol-self")
    assert drafted["response"] == plain["response"]
    assert drafted["eval_count"] == plain["eval_count"]
    # The model drafting for itself proposes what it picks: its drafts are kept (all but
    # a near-tie, where its own context's kernels may round the other way).
    assert drafted["draft_count"] > 0
    assert drafted["draft_accepted_count"] >= 0.8 * drafted["draft_count"]
    ps = httpx.get(f"{daemon.url}/api/ps", timeout=30).json()["models"]
    draft = next(m for m in ps if m["name"] == "smol-self:latest")["draft"]
    assert draft["model"] == CHAT
    assert draft["size"] > 0
    table = corral(daemon, "ps")
    assert table.returncode == 0 and "(draft smollm2:135m" in table.stdout, table.stdout

    random = generate(daemon, "smol-random")
    assert random["response"] == plain["response"]
    assert random["eval_count"] == plain["eval_count"]
    # Sure of itself and wrong: it proposes, and verification keeps (almost) none of it.
    assert random["draft_count"] > 0
    assert random["draft_accepted_count"] < random["draft_count"]

    shown = httpx.post(f"{daemon.url}/api/show", json={"model": "smol-random"}, timeout=30).json()
    assert shown["draft"]["digest"] == digest and shown["draft"]["model"] == ""
    assert shown["draft"]["details"]["family"] == "llama"
    assert "\nDRAFT /" in shown["modelfile"]
    out = corral(daemon, "show", "smol-self")
    assert out.returncode == 0 and "  Draft\n    model               smollm2:135m" in out.stdout


def test_a_draft_with_another_vocabulary_is_refused(daemon: Daemon, tmp_path: Path,
                                                    draft_gguf: Path) -> None:
    r = create(daemon, {"model": "smol-gemma", "from": CHAT, "draft": BASE})
    assert r.status_code == 400, r.text
    assert "vocabulary is not the model's" in r.json()["error"]
    assert create(daemon, {"model": "x", "from": CHAT, "draft": "nope:1"}).status_code == 404
    names = [m["name"] for m in httpx.get(f"{daemon.url}/api/tags").json()["models"]]
    assert "smol-gemma:latest" not in names  # nothing written

    # The CLI: a DRAFT by name is refused the same way; a DRAFT file is uploaded.
    (tmp_path / "Modelfile").write_text(f"FROM {CHAT}\nDRAFT {BASE}\n")
    out = corral(daemon, "create", "smol-gemma", "-f", str(tmp_path / "Modelfile"))
    last = out.stderr.strip().splitlines()[-1]  # after the progress lines
    assert out.returncode == 1 and last.startswith("Error: "), out.stderr
    assert "vocabulary is not the model's: its tokenizer is 'llama'" in last
    (tmp_path / "Modelfile").write_text(f"FROM {CHAT}\nDRAFT ./{draft_gguf.name}\n")
    (tmp_path / draft_gguf.name).symlink_to(draft_gguf)
    out = corral(daemon, "create", "smol-file", "-f", str(tmp_path / "Modelfile"))
    assert out.returncode == 0, out.stderr
    shown = corral(daemon, "show", "smol-file")
    assert "  Draft\n    architecture        llama" in shown.stdout, shown.stdout


def test_a_draft_that_cannot_load_leaves_the_model_answering(
        daemon_factory: DaemonFactory, starter_store: Store, chat_gguf: Path,
        tmp_path: Path) -> None:
    """A draft model can only help: one llama.cpp cannot load (here the chat starter's
    vocabulary with no weights at all, which passes the vocabulary check) leaves the model
    loaded without it, answering from its own weights; `ps`, `corral ps` and `show` say
    the draft is off, and why."""
    from benchmarks.gpu_model import cut_tokenizer

    daemon = daemon_factory(starter_store, NUM_PARALLEL="1", DETERMINISTIC="1",
                            MAX_LOADED_MODELS="1")
    broken = tmp_path / "no-weights.gguf"
    cut_tokenizer(chat_gguf, broken)
    digest = file_sha256(broken)
    assert httpx.post(f"{daemon.url}/api/blobs/{digest}", content=broken.read_bytes(),
                      timeout=60).status_code == 201
    r = create(daemon, {"model": "smol-broken", "from": CHAT,
                        "draft_files": {"draft.gguf": digest}})
    assert r.status_code == 200, r.text
    plain = generate(daemon, CHAT)
    answered = generate(daemon, "smol-broken")
    assert answered["response"] == plain["response"]  # (its drafts are n-grams')
    ps = httpx.get(f"{daemon.url}/api/ps", timeout=30).json()["models"]
    draft = next(m for m in ps if m["name"] == "smol-broken:latest")["draft"]
    assert draft["error"] and draft["size"] == 0
    table = corral(daemon, "ps")
    assert "off: it did not load" in table.stdout, table.stdout
    shown = httpx.post(f"{daemon.url}/api/show", json={"model": "smol-broken"}, timeout=30)
    assert shown.json()["draft"]["error"] == draft["error"]
