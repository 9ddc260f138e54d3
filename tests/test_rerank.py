"""Reranking at three levels: the request shapes and ordering (pure), every status and
shape over HTTP, and the scores against llama.cpp's own pooled rank output on the same
GGUF (tests/rerank_model.py: a tiny random Qwen3-Reranker), computed in-process through
llama-cpp-python's low-level API one document at a time, as llama-server's slots do."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path
from typing import Any, Iterator

import cohere
import httpx
import llama_cpp as L
import ollama
import pytest

from corral.api.wire import parse
from corral.api.wire.rerank import RerankRequest
from corral.errors import BadRequest
from corral.runner.llama.embedding import SEQS, EmbeddingContext, _groups
from corral.runner.rankwire import RerankJob
from corral.runner.llama.rerank import is_reranker, prompt_tokens, rerank_template
from corral.registry.store import Store
from corral.server.daemon import Daemon
from corral.server.chat.models import capabilities
from corral.server.pipeline.rerank import order
from tests.rerank_model import write_reranker

RERANKER, PLAIN, CHAT = "reranker", "reranker-plain", "smollm2:135m"
QUERY = "What is the capital of France?"
DOCS = ["Paris is the capital and largest city of France.", "Bananas are yellow.",
        "The Eiffel Tower is in Paris.", "Berlin is the capital of Germany.",
        "France borders Spain.", "<|im_end|> control text stays text in a document",
        "Le français est parlé en France.", "x", "Rome.", "A long document " * 40]


# ---- pure ----------------------------------------------------------------------------

def test_documents_are_strings_or_text_objects() -> None:
    wire = parse(RerankRequest, {"model": "m", "query": "q",
                                 "documents": ["a", {"text": "b"}], "top_n": 1})
    assert wire.texts() == ["a", "b"] and wire.top_n == 1 and not wire.return_documents


@pytest.mark.parametrize("body,field", [
    ({"query": "q", "documents": ["a"], "top_n": 0}, "top_n"),
    ({"query": "q", "documents": "a"}, "documents"),
    ({"query": 3, "documents": ["a"]}, "query"),
    ({"query": "q", "documents": [{"txt": "a"}]}, "documents"),
    ({"documents": ["a"]}, "query"),
])
def test_a_wrong_field_is_named(body: dict[str, Any], field: str) -> None:
    with pytest.raises(BadRequest, match=field):
        parse(RerankRequest, body)


def test_results_are_best_first_ties_in_order_and_cut_to_top_n() -> None:
    assert order([0.1, 0.9, 0.5, 0.9], None) == [(1, 0.9), (3, 0.9), (2, 0.5), (0, 0.1)]
    assert order([0.1, 0.9, 0.5], 2) == [(1, 0.9), (2, 0.5)]
    assert order([0.1], 5) == [(0, 0.1)]


def test_a_reranker_only_reranks() -> None:
    assert capabilities("{{ .Prompt }}{{ .Suffix }}<think>", False, False, True) == ("rerank",)


def test_documents_are_packed_into_batches_of_whole_sequences() -> None:
    docs = [[1] * n for n in (300, 300, 100, 600, 10)]
    assert [[len(d) for d in g] for g in _groups(docs, 700)] == [[300, 300, 100], [600, 10]]
    assert [len(g) for g in _groups([[1]] * (2 * SEQS + 1), 512)] == [SEQS, SEQS, 1]


def test_the_runner_job_checks_its_fields() -> None:
    assert RerankJob.from_json({"query": "q", "documents": ["a"]}).documents == ("a",)
    with pytest.raises(BadRequest):
        RerankJob.from_json({"query": "q", "documents": [1]})


# ---- llama.cpp, in-process -----------------------------------------------------------

@pytest.fixture(scope="module")
def plain_gguf(chat_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same kind of reranker without a rerank template: llama-server's fallback prompt."""
    return write_reranker(chat_gguf, tmp_path_factory.mktemp("plain") / "plain.gguf",
                          seed=1, template=False)


@pytest.fixture(scope="module")
def models(reranker_gguf: Path, plain_gguf: Path) -> Iterator[dict[str, Any]]:
    L.llama_backend_init()
    loaded = {}
    for name, path in ((RERANKER, reranker_gguf), (PLAIN, plain_gguf)):
        params = L.llama_model_default_params()
        params.n_gpu_layers = 0
        loaded[name] = L.llama_model_load_from_file(str(path).encode(), params)
        assert loaded[name]
    yield loaded
    for model in loaded.values():
        L.llama_model_free(model)


def tokenize(vocab: Any, text: str, parse_special: bool) -> list[int]:
    data = text.encode()
    out = (L.llama_token * (len(data) + 8))()
    n = L.llama_tokenize(vocab, data, len(data), out, len(out), False, parse_special)
    return list(out[:n])


def llama_prompt(model: Any, query: str, doc: str) -> list[int]:
    """format_prompt_rerank (tools/server/server-common.cpp), written out again here."""
    vocab = L.llama_model_get_vocab(model)
    raw = L.llama_model_chat_template(model, b"rerank")
    if raw:
        text = raw.decode().replace("{query}", query).replace("{document}", doc)
        return tokenize(vocab, text, True)
    eos = L.llama_vocab_eos(vocab)
    flags = (L.llama_vocab_get_add_bos(vocab), L.llama_vocab_get_add_eos(vocab),
             L.llama_vocab_get_add_sep(vocab))
    return ([L.llama_vocab_bos(vocab)] * flags[0] + tokenize(vocab, query, False)
            + [eos] * flags[1] + [L.llama_vocab_sep(vocab)] * flags[2]
            + tokenize(vocab, doc, False) + [eos] * flags[1])


def llama_score(model: Any, tokens: list[int]) -> float:
    """One document in a context of its own, as a llama-server slot scores it: the first
    of the pooled rank outputs (send_rerank's embd[0])."""
    params = L.llama_context_default_params()
    params.n_ctx = params.n_batch = params.n_ubatch = 1024
    params.embeddings, params.pooling_type = True, L.LLAMA_POOLING_TYPE_RANK
    params.n_threads = params.n_threads_batch = 2
    ctx = L.llama_init_from_model(model, params)
    batch = L.llama_batch_init(len(tokens), 0, 1)
    try:
        for i, token in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, i, 1
            batch.seq_id[i][0], batch.logits[i] = 0, True
        batch.n_tokens = len(tokens)
        assert L.llama_decode(ctx, batch) == 0
        return float(ctypes.cast(L.llama_get_embeddings_seq(ctx, 0),
                                 ctypes.POINTER(ctypes.c_float))[0])
    finally:
        L.llama_batch_free(batch)
        L.llama_free(ctx)


@pytest.mark.parametrize("name", [RERANKER, PLAIN])
def test_prompts_and_batched_scores_are_llama_cpps(models: dict[str, Any], name: str) -> None:
    model = models[name]
    assert is_reranker(model)
    template = rerank_template(model)
    assert (template is not None) == (name == RERANKER)
    vocab = L.llama_model_get_vocab(model)
    prompts = [prompt_tokens(vocab, template, QUERY, doc) for doc in DOCS]
    assert prompts == [llama_prompt(model, QUERY, doc) for doc in DOCS]
    embed_ctx = EmbeddingContext(model, 1024, 2)
    try:
        scores = [out[0] for out in embed_ctx.embed(prompts, truncate=False)]
        # Several documents to a decode, as many as the context's cells hold.
        assert embed_ctx.decodes == len(_groups(prompts, embed_ctx.capacity)) < len(DOCS) / 2
    finally:
        embed_ctx.free()
    expected = [llama_score(model, tokens) for tokens in prompts]
    assert scores == pytest.approx(expected, abs=1e-4)
    assert max(expected) - min(expected) > 1e-3  # the documents are told apart


# ---- the daemon ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def daemon(starter_store: Store, reranker_gguf: Path, plain_gguf: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    from tests.support import start_daemon

    d = start_daemon(starter_store, tmp_path_factory.mktemp("rerank"), MAX_EMBED_INPUTS="16",
                     MAX_EMBED_TOKENS="4000")
    client = ollama.Client(host=d.url)
    for name, path in ((RERANKER, reranker_gguf), (PLAIN, plain_gguf)):
        digest = client.create_blob(path)
        assert client.create(model=name, files={path.name: digest}).status == "success"
    yield d
    d.shutdown()


def post(d: Daemon, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(d.url + path, json=body, timeout=120)


@pytest.mark.parametrize("name", [RERANKER, PLAIN])
def test_the_daemon_scores_as_llama_cpp(daemon: Daemon, models: dict[str, Any],
                                        name: str) -> None:
    r = post(daemon, "/v1/rerank", {"model": name, "query": QUERY, "documents": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    expected = [llama_score(models[name], llama_prompt(models[name], QUERY, d)) for d in DOCS]
    got = {res["index"]: res["relevance_score"] for res in body["results"]}
    assert [got[i] for i in range(len(DOCS))] == pytest.approx(expected, abs=1e-4)
    scores = [res["relevance_score"] for res in body["results"]]
    assert scores == sorted(scores, reverse=True)
    n = sum(len(llama_prompt(models[name], QUERY, d)) for d in DOCS)
    assert body["usage"] == {"prompt_tokens": n, "total_tokens": n}
    assert body["model"] == name and body["object"] == "list"


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/v1/reranking"])
def test_jina_shape_top_n_and_documents(daemon: Daemon, path: str) -> None:
    docs = ["Paris.", {"text": "Bananas."}, "Berlin."]
    body = post(daemon, path, {"model": RERANKER, "query": QUERY, "documents": docs,
                               "top_n": 2, "return_documents": True}).json()
    assert len(body["results"]) == 2
    texts = ["Paris.", "Bananas.", "Berlin."]
    for res in body["results"]:
        assert set(res) == {"index", "relevance_score", "document"}
        assert res["document"] == {"text": texts[res["index"]]}
    bare = post(daemon, path, {"model": RERANKER, "query": QUERY, "documents": texts}).json()
    assert all(set(res) == {"index", "relevance_score"} for res in bare["results"])
    assert bare["results"][:2] == [{k: v for k, v in res.items() if k != "document"}
                                   for res in body["results"]]


def test_cohere_shape(daemon: Daemon) -> None:
    body = post(daemon, "/v2/rerank", {"model": RERANKER, "query": QUERY,
                                       "documents": DOCS[:3], "top_n": 2}).json()
    assert set(body) == {"id", "results", "meta"} and len(body["results"]) == 2
    assert body["meta"]["api_version"] == {"version": "2"}


@pytest.mark.parametrize("body,status,words", [
    ({"model": CHAT, "query": "q", "documents": ["a"]}, 400, "is not a reranker"),
    ({"model": "nope", "query": "q", "documents": ["a"]}, 404, "not found"),
    ({"model": RERANKER, "query": "", "documents": ["a"]}, 400, "query"),
    ({"model": RERANKER, "query": "q", "documents": []}, 400, "documents"),
    ({"model": RERANKER, "query": "q", "documents": ["a"] * 17}, 400, "limit of 16"),
    ({"model": RERANKER, "query": "q", "documents": ["a", "word " * 1500]}, 400,
     "document 1 is too long: its prompt is 15"),
    ({"query": "q", "documents": ["a"]}, 400, "model is required"),
])
def test_bad_input_is_a_status_in_each_shape(daemon: Daemon, body: dict[str, Any],
                                             status: int, words: str) -> None:
    jina = post(daemon, "/v1/rerank", body)
    assert jina.status_code == status and words in jina.json()["error"]["message"]
    co = post(daemon, "/v2/rerank", body)
    assert co.status_code == status and words in co.json()["message"]


def test_the_documents_prompts_together_have_a_bound(daemon: Daemon) -> None:
    """As an embed's inputs: over CORRAL_MAX_EMBED_TOKENS in all is a 400 that names the
    limit, and the runner goes on scoring."""
    long = ["the quick brown fox jumps over the lazy dog " * 30] * 16  # ~16 x 400 tokens
    r = post(daemon, "/v1/rerank", {"model": RERANKER, "query": "fox", "documents": long})
    assert r.status_code == 400 and "CORRAL_MAX_EMBED_TOKENS" in r.json()["error"]["message"]
    ok = post(daemon, "/v1/rerank", {"model": RERANKER, "query": "fox",
                                     "documents": long[:2]})
    assert ok.status_code == 200, ok.text


def test_a_reranker_neither_generates_nor_embeds(daemon: Daemon) -> None:
    gen = post(daemon, "/api/generate", {"model": RERANKER, "prompt": "hi"})
    assert gen.status_code == 400 and "is a reranker" in gen.json()["error"]
    emb = post(daemon, "/v1/embeddings", {"model": RERANKER, "input": "hi"})
    assert emb.status_code == 400 and "does not embed" in emb.json()["error"]["message"]
    shown = post(daemon, "/api/show", {"model": RERANKER}).json()
    assert shown["capabilities"] == ["rerank"]


def test_the_cohere_sdk_reranks_unmodified(daemon: Daemon) -> None:
    co = cohere.ClientV2(api_key="unused", base_url=daemon.url)
    out = co.rerank(model=RERANKER, query=QUERY, documents=DOCS[:4], top_n=3)
    assert len(out.results) == 3
    scores = [r.relevance_score for r in out.results]
    assert scores == sorted(scores, reverse=True)
    assert {r.index for r in out.results} <= set(range(4))
    with pytest.raises(cohere.BadRequestError):
        co.rerank(model=CHAT, query=QUERY, documents=["a"])
    with pytest.raises(cohere.NotFoundError):
        co.rerank(model="nope", query=QUERY, documents=["a"])


def test_langchain_cohere_rerank_through_a_cohere_base_url(daemon: Daemon) -> None:
    from langchain_cohere import CohereRerank
    from langchain_core.documents import Document

    ranker = CohereRerank(model=RERANKER, cohere_api_key="unused", base_url=daemon.url,
                          top_n=2)
    kept = ranker.compress_documents([Document(page_content=d) for d in DOCS[:4]], QUERY)
    direct = post(daemon, "/v1/rerank", {"model": RERANKER, "query": QUERY,
                                         "documents": DOCS[:4], "top_n": 2}).json()
    assert [d.page_content for d in kept] == [DOCS[r["index"]] for r in direct["results"]]
    assert [d.metadata["relevance_score"] for d in kept] == pytest.approx(
        [r["relevance_score"] for r in direct["results"]], abs=1e-6)


def test_corral_run_explains_a_reranker(daemon: Daemon) -> None:
    from tests.test_cli import CORRAL, env_for

    out = subprocess.run([*CORRAL, "run", RERANKER, "Hi"], capture_output=True, text=True,
                         env=env_for(daemon), timeout=180)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.startswith(f"Error: {RERANKER} is a reranker")
    assert "/v1/rerank" in out.stderr
