"""/infill and a completion's suffix on real models, against llama.cpp's own code.

The FIM models are SmolLM2 copies with FIM tokens (tests/fim_model.py). The prompt is
written out here as llama-server's format_prompt_infill lays it out, with llama.cpp's
tokenizer and vocabulary, and decoded greedily through llama-cpp-python's low-level API;
Corral's /infill must answer the same tokens."""

from __future__ import annotations

import ctypes
import json
from pathlib import Path
from typing import Any, Iterator

import httpx
import llama_cpp as L
import pytest

from corral.registry.create import CreateRequest, create_model
from corral.registry.gguf import inspect_gguf
from corral.registry.store import Store
from corral.runner.llama import native
from corral.runner.fim import FimTokens, Infill, infill_tokens
from corral.server.daemon import Daemon
from tests.fim_model import write_fim_gguf
from tests.support import llama_greedy

pytestmark = pytest.mark.model

CHAT = "smollm2:135m"
PREFIX = "Once upon a time, there was a"  # a prompt both copies answer at some length
SUFFIX = "\nThe end.\n"
EXTRA = [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n"}]
N = 12
GREEDY = {"temperature": 0, "seed": 1, "n_predict": N}


@pytest.fixture(scope="session")
def fim_ggufs(chat_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fim")
    return {"fim": write_fim_gguf(chat_gguf, root / "fim.gguf"),
            "fimrepo": write_fim_gguf(chat_gguf, root / "fimrepo.gguf", repo=True)}


@pytest.fixture(scope="module")
def daemon(starter_store: Store, fim_ggufs: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    from tests.support import start_daemon

    root = tmp_path_factory.mktemp("infill")
    d = start_daemon(starter_store, root, NUM_PARALLEL="1", MAX_LOADED_MODELS="1",
                      CONTEXT_LENGTH="4096")  # over n_batch (2048): the extra files fit
    for name, path in fim_ggufs.items():
        with path.open("rb") as f:
            blob = d.store.write_blob(iter(lambda: f.read(1 << 20), b""))[0]
        create_model(d.store, CreateRequest(model=name, files={path.name: blob}))
    yield d
    d.shutdown()


def post(d: Daemon, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(d.url + path, json=body, timeout=120)


class Vocab:
    """llama.cpp's model, in-process: its vocabulary, tokenizer and a greedy decode."""

    def __init__(self, path: Path) -> None:
        native.init_backend()
        self.model = L.llama_model_load_from_file(str(path).encode(),
                                                  L.llama_model_default_params())
        self.vocab = L.llama_model_get_vocab(self.model)

    def fim(self) -> FimTokens:
        v = self.vocab
        bos = L.llama_vocab_bos(v) if L.llama_vocab_get_add_bos(v) else -1
        return FimTokens(L.llama_vocab_fim_pre(v), L.llama_vocab_fim_suf(v),
                         L.llama_vocab_fim_mid(v), L.llama_vocab_fim_rep(v),
                         L.llama_vocab_fim_sep(v), bos)

    def tok(self, text: str) -> list[int]:
        return native.tokenize(self.vocab, text, False, False)

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        return llama_greedy(self.model, prompt, n,
                            lambda token: bool(L.llama_vocab_is_eog(self.vocab, token)))

    def text(self, tokens: list[int]) -> str:
        return b"".join(native.token_bytes(self.vocab, t) for t in tokens).decode()

    def close(self) -> None:
        L.llama_model_free(self.model)


def _laid_out(v: Vocab, repo: bool) -> list[int]:
    """format_prompt_infill's layout, written out (server-common.cpp)."""
    fim = v.fim()
    head = [fim.rep, *v.tok("myproject\n")]
    if repo:
        head += [fim.sep, *v.tok("util.py\n"), *v.tok(EXTRA[0]["text"]),
                 fim.sep, *v.tok("filename\n")]
    else:
        head += [*v.tok("\n\n--- snippet ---\n\n"), *v.tok(EXTRA[0]["text"])]
    return head + [fim.pre, *v.tok(PREFIX), fim.suf, *v.tok(SUFFIX), fim.mid]


@pytest.mark.parametrize("name", ["fim", "fimrepo"])
def test_prompt_and_greedy_reply_are_llama_cpps(daemon: Daemon, fim_ggufs: dict[str, Path],
                                                name: str) -> None:
    v = Vocab(fim_ggufs[name])
    try:
        prompt = _laid_out(v, name == "fimrepo")
        infill = Infill(PREFIX, SUFFIX, (("util.py", EXTRA[0]["text"]),))
        assert infill_tokens(infill, v.fim(), lambda t, s: native.tokenize(
            v.vocab, t, False, s), 4096) == prompt
        reply = v.greedy(prompt, N)
        expected = v.text(reply)
    finally:
        v.close()
    body = {"model": name, "input_prefix": PREFIX, "input_suffix": SUFFIX,
            "input_extra": EXTRA, **GREEDY}
    r = post(daemon, "/infill", body)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["content"] == expected
    # The end token a reply stopped at was sampled too, and counts, as in llama-server.
    assert got["tokens_predicted"] == len(reply) + (len(reply) < N)
    assert got["stop"] is True and got["model"] == name
    assert set(got["timings"]) >= {"prompt_n", "prompt_ms", "predicted_n", "cache_n"}


def test_registry_finds_the_fim_tokens_llama_cpp_finds(chat_gguf: Path,
                                                       fim_ggufs: dict[str, Path]) -> None:
    for path in [chat_gguf, *fim_ggufs.values()]:
        v = Vocab(path)
        try:
            fim = v.fim()
        finally:
            v.close()
        ids = {"pre": fim.pre, "suf": fim.suf, "mid": fim.mid, "rep": fim.rep, "sep": fim.sep}
        assert inspect_gguf(path).fim == {role for role, t in ids.items() if t >= 0}, path


def test_stream_is_llama_servers_events(daemon: Daemon) -> None:
    body = {"model": "fim", "input_prefix": PREFIX, "input_suffix": SUFFIX, "stream": True,
            **GREEDY}
    whole = post(daemon, "/infill", {**body, "stream": False}).json()
    with httpx.stream("POST", daemon.url + "/infill", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    events = [json.loads(line.removeprefix("data: ")) for line in lines]
    assert all(line.startswith("data: ") for line in lines) and "[DONE]" not in lines[-1]
    assert all(e["stop"] is False for e in events[:-1]) and events[-1]["stop"] is True
    assert "".join(e["content"] for e in events) == whole["content"]
    assert events[-1]["tokens_predicted"] == whole["tokens_predicted"]


def test_a_model_without_fim_tokens_is_a_400_that_says_so(daemon: Daemon) -> None:
    r = post(daemon, "/infill", {"model": CHAT, "input_prefix": "a", "input_suffix": "b"})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (
        "Infill is not supported by this model: prefix token is missing. suffix token is "
        "missing. middle token is missing. ")


def test_statuses(daemon: Daemon) -> None:
    r = post(daemon, "/infill", {"model": "nope", "input_prefix": "a", "input_suffix": "b"})
    assert r.status_code == 404 and "error" in r.json()
    r = post(daemon, "/infill", {"model": "fim", "input_prefix": "a"})
    assert r.status_code == 400 and "input_suffix" in r.json()["error"]["message"]
    r = post(daemon, "/infill", {"model": "fim", "input_prefix": "a", "input_suffix": "",
                                 "input_extra": [{"filename": 3, "text": "x"}]})
    assert r.status_code == 400 and "input_extra" in r.json()["error"]["message"]
    post(daemon, "/api/generate", {"model": "fim", "keep_alive": 0})
    post(daemon, "/api/generate", {"model": CHAT, "keep_alive": 0})
    r = post(daemon, "/infill", {"input_prefix": "a", "input_suffix": "b"})
    assert r.status_code == 400 and "model is required" in r.json()["error"]["message"]
    post(daemon, "/infill", {"model": "fim", "input_prefix": "a", "input_suffix": "b",
                             "n_predict": 1})
    r = post(daemon, "/infill", {"input_prefix": "a", "input_suffix": "b", "n_predict": 1})
    assert r.status_code == 200 and r.json()["model"] == "fim:latest"  # the one loaded


def test_suffix_uses_fim_tokens_where_the_template_cannot(daemon: Daemon) -> None:
    infill = post(daemon, "/infill", {"model": "fim", "input_prefix": PREFIX,
                                      "input_suffix": SUFFIX, **GREEDY}).json()["content"]
    opts = {"temperature": 0, "seed": 1, "num_predict": N, "top_k": 40, "top_p": 0.95,
            "min_p": 0.05, "repeat_penalty": 1.0}
    r = post(daemon, "/api/generate", {"model": "fim", "prompt": PREFIX, "suffix": SUFFIX,
                                       "stream": False, "options": opts})
    assert r.status_code == 200 and r.json()["response"] == infill
    r = post(daemon, "/v1/completions", {"model": "fim", "prompt": PREFIX, "suffix": SUFFIX,
                                         "max_tokens": N, "temperature": 0, "seed": 1})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == infill
    for path in ("/api/generate", "/v1/completions"):
        r = post(daemon, path, {"model": CHAT, "prompt": "a", "suffix": "b", "stream": False})
        assert r.status_code == 400
        assert "smollm2:135m does not support insert" in r.text


def test_a_generate_suffix_takes_the_whole_prefix_and_suffix(daemon: Daemon) -> None:
    """/infill's budgets (llama-server's: three quarters of a batch of prefix) are its
    own: /api/generate's prompt and suffix go in whole, as Ollama sends them."""
    prefix = "def f(x):\n    return x\n\n" * 160  # ~2,000 tokens: over /infill's 1,536
    body = {"model": "fim", "prompt": prefix, "suffix": SUFFIX, "stream": False,
            "options": {"temperature": 0, "num_predict": 1}}
    r = post(daemon, "/api/generate", body)
    assert r.status_code == 200, r.text
    whole = len(daemon_tokens(daemon, prefix)) + len(daemon_tokens(daemon, SUFFIX))
    assert r.json()["prompt_eval_count"] >= whole


def test_show_lists_insert_for_fim_models_only(daemon: Daemon) -> None:
    def caps(model: str) -> list[str]:
        return post(daemon, "/api/show", {"model": model}).json()["capabilities"]
    assert "insert" in caps("fim") and "insert" in caps("fimrepo")
    assert "insert" not in caps(CHAT)


def test_a_cached_suffix_is_shifted_into_place_for_infill_only(fim_ggufs: dict[str, Path]
                                                                ) -> None:
    """llama-server's --cache-reuse: a word deleted before the suffix (a backspace) keeps
    the suffix's KV, shifted; a request that did not ask for shifted KV (reuse_chunk 0)
    evaluates its prompt whole rather than keep it, and leaves an exact cache behind."""
    from corral.runner.llama.context import EngineConfig
    from corral.runner.engine.engine import Engine
    from corral.runner.jobs import Job, SamplingParams, Token

    engine = Engine(str(fim_ggufs["fim"]), EngineConfig(n_slots=1, num_ctx=1024))
    engine.start()
    suffix = engine.tokenize(" and they all lived happily ever after in the old castle by "
                             "the sea, and nobody was ever sad again.", add_special=False)

    def evaluated(prefix: str, reuse: int) -> int:
        prompt = [7, *engine.tokenize(prefix, add_special=False), 8, *suffix, 9]
        job = engine.submit(Job(prompt=prompt, params=SamplingParams(temperature=0),
                                num_predict=2, reuse_chunk=reuse))
        while isinstance(event := job.events.get(timeout=300), Token):
            pass
        return int(event.stats.prompt_eval_count)

    try:
        assert evaluated("Once upon a time there was a little girl", 16) > len(suffix)
        assert evaluated("Once upon a time there was a little", 16) == 1
        assert evaluated("Once upon a time there was a little", 0) > len(suffix)
        assert evaluated("Once upon a time there was a little", 0) == 1
    finally:
        engine.stop()


STORY_END = (" and they all lived happily ever after in the old castle by the sea, and nobody"
             " was ever sad again.")


@pytest.mark.parametrize("config", [
    {"n_slots": 1}, {"n_slots": 2, "kv_pool": 2048}, {"n_slots": 4, "start_slots": 1},
    {"n_slots": 2}], ids=["one-slot", "pool", "elastic-at-one-stream", "streams"])
def test_text_typed_before_a_cached_suffix_evaluates_only_itself(
        fim_ggufs: dict[str, Path], config: dict[str, int]) -> None:
    """A keystroke inserts before an infill's suffix. Where the slots share one KV stream
    (one slot, or a pool) the suffix's cells wait on the scratch sequence while the typed
    tokens are decoded, then join at their new positions: only the typed tokens and the
    last one are evaluated, and the sequence decodes on from consistent positions (else
    llama_decode refuses the batch and the job fails). An elastic context that rests at
    one stream (the default) has it too. Per-slot streams have no scratch sequence: the
    suffix is evaluated again, as llama-server does."""
    from corral.runner.engine.engine import Engine
    from corral.runner.jobs import Done, Job, SamplingParams, Token
    from corral.runner.llama.context import EngineConfig

    engine = Engine(str(fim_ggufs["fim"]), EngineConfig(num_ctx=1024, **config))
    engine.start()
    suffix = engine.tokenize(STORY_END, add_special=False)

    def run(prefix: str) -> tuple[int, int]:
        body = engine.tokenize(prefix, add_special=False)
        job = engine.submit(Job(prompt=[7, *body, 8, *suffix, 9], reuse_chunk=16,
                                params=SamplingParams(temperature=0), num_predict=4))
        while isinstance(event := job.events.get(timeout=300), Token):
            pass
        assert isinstance(event, Done), event
        return int(event.stats.prompt_eval_count), int(event.stats.eval_count)

    try:
        assert run("Once upon a time there was a little")[0] > len(suffix)
        typed, generated = run("Once upon a time there was a little girl who")
        assert generated == 4
        if engine.llama.scratch is None:
            assert typed > len(suffix)
        else:
            assert 2 <= typed <= 4  # " girl who", and the last token again
            assert engine.schedule.parking.run is None  # joined, and the scratch sequence free
        # The joined KV holds the whole prompt at its positions: the same request again
        # evaluates only its last token.
        assert run("Once upon a time there was a little girl who")[0] == 1
    finally:
        engine.stop()


def test_a_keystroke_in_the_editor_evaluates_what_it_typed(daemon: Daemon) -> None:
    """llama.vim's requests as a person types on a line (the line so far in `prompt`,
    which ends the FIM prefix): after the first, each evaluates the typed tokens and the
    last one, not the suffix behind them (timings.prompt_n, llama-server's count)."""
    above = "def area(width: float, height: float) -> float:\n"
    below = "\n\ndef perimeter(width: float, height: float) -> float:\n" \
            "    return 2 * (width + height)\n\n\nprint(area(2, 3), perimeter(2, 3))\n"
    line = "    result = width * height"
    counts = []
    for end in (8, 16, 22, len(line)):
        r = post(daemon, "/infill", {"model": "fim", "input_prefix": above,
                                     "prompt": line[:end], "input_suffix": below, **GREEDY})
        assert r.status_code == 200, r.text
        counts.append(r.json()["timings"]["prompt_n"])
    suffix = len(daemon_tokens(daemon, below))
    assert counts[0] > suffix
    assert all(0 < n < suffix // 2 for n in counts[1:]), counts


def daemon_tokens(d: Daemon, text: str) -> list[int]:
    r = post(d, "/tokenize", {"model": "fim", "content": text})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]
