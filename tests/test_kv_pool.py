"""KV pool mode: slots share one buffer, the newest sequence is preempted when it fills.

Level 1 tests the pure accounting; the rest runs the real starter with a pool
far smaller than its sequences need, so preemption and resume must happen,
and checks that every stream still comes out whole: the streamed pieces join to
the final text, nothing duplicated or missing, and eval_count equals the tokens
that were streamed.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Iterator

import pytest

from corral.runner.jobs import Done, Job, SamplingParams, Token
from corral.runner.engine.kvpool import KVPool
from corral.runner.slots.sequence import Sequence
from corral.runner.slots.slot import Slot, SlotState


def slot(seq: int, state: SlotState, n_past: int, pending: int = 0, t: float = 0.0) -> Slot:
    s = Slot(seq_id=seq, num_ctx=256, state=state, cached=[1] * n_past, last_used=t)
    if state is not SlotState.IDLE:
        s.sequence = Sequence(Job(prompt=[1]), pending=[2] * pending, t_start=t)
    return s


def test_admission_counts_running_prompts_and_a_reserve() -> None:
    pool = KVPool(size=512, reserve=32)
    slots = [slot(0, SlotState.DECODE, 200), slot(1, SlotState.PREFILL, 50, pending=100),
             slot(2, SlotState.IDLE, 300)]  # idle caches are evictable: they never block
    assert pool.admits(slots, 130)  # 350 committed + 130 + 32 = 512
    assert not pool.admits(slots, 131)
    assert pool.admits([slot(0, SlotState.IDLE, 0)], 10_000)  # an empty pool takes anything
    pool.pressure = True  # after a preemption, nothing new until a sequence ends
    assert not pool.admits(slots, 10)
    assert pool.admits([slot(0, SlotState.IDLE, 0)], 10)


def test_shortfall_victim_and_eviction_order() -> None:
    slots = [slot(0, SlotState.DECODE, 250, t=1.0), slot(1, SlotState.DECODE, 250, t=3.0),
             slot(2, SlotState.DECODE, 10, t=2.0), slot(3, SlotState.IDLE, 5, t=0.5),
             slot(4, SlotState.IDLE, 0, t=0.1)]
    pool = KVPool(size=512)
    assert pool.shortfall(slots, 3) == 250 + 250 + 10 + 5 + 3 - 512
    assert [s.seq_id for s in KVPool.evictable(slots)] == [3]
    victim = KVPool.victim(slots)
    assert victim is not None and victim.seq_id == 1  # the newest, not the biggest
    assert KVPool.victim([slot(0, SlotState.DECODE, 500)]) is None  # alone it always fits


@pytest.fixture(scope="module")
def pooled(chat_gguf: Path) -> Iterator[Any]:
    from corral.runner.llama.context import EngineConfig
    from corral.runner.engine.engine import Engine

    # Three sequences of about 10 + 100 tokens need 330 cells; the pool has 256.
    eng = Engine(str(chat_gguf), EngineConfig(n_slots=3, num_ctx=192, kv_pool=256,
                                              deterministic=True))
    eng.start()
    yield eng
    eng.stop()


N = 100


def drain(job: Job) -> tuple[list[Token], Any]:
    """A job's tokens, then its done line's stats."""
    tokens: list[Token] = []
    while True:
        event = job.events.get(timeout=300)
        if isinstance(event, Token):
            tokens.append(event)
        else:
            assert isinstance(event, Done), event
            return tokens, event.stats


def collect(job: Job) -> tuple[list[str], Any]:
    tokens, stats = drain(job)
    return [t.text for t in tokens], stats


@pytest.mark.model
def test_preempted_streams_resume_whole(pooled: Any) -> None:
    prompts = [f"Write a long story about a {w}." for w in ("cat", "ship", "tree")]
    results: list[tuple[list[str], dict[str, Any]]] = [([], {})] * len(prompts)

    def worker(i: int) -> None:
        job = pooled.submit(Job(prompt=pooled.tokenize(prompts[i]), num_predict=N,
                                ignore_eos=True, params=SamplingParams(temperature=0)))
        results[i] = collect(job)

    before = pooled.status()["preemptions"]
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert pooled.status()["preemptions"] > before
    for pieces, stats in results:
        assert stats.done_reason == "length" and stats.eval_count == N
        generated = stats.context[-N:]
        assert "".join(pieces) == pooled.detokenize(generated)
    status = pooled.status()
    assert status["kv_reserved"] == 256 and status["kv_used"] <= 256
    # ...and each is what a run that was never preempted makes of the same request.
    for prompt, (_, stats) in zip(prompts, results):
        assert_greedy_alone(pooled, pooled.tokenize(prompt), list(stats.context[-N:]))


MARGIN = 0.5  # nats between two picks that make a near-tie (seen: 0.1 here, 0.29 on CI)
# How many near-ties may flip in a run. Which rows share a batch depends on thread timing,
# and the batch's shape changes a logit in its last places, so the count varies from run to
# run (seen here: 0 to 3 of 100, once 3 at the pinned commit before any change). A resume
# that lost its KV is caught by MARGIN at its first wrong token, not by this count.
NEAR_TIES = N // 20


def assert_greedy_alone(engine: Any, prompt: list[int], generated: list[int]) -> None:
    """`generated` is what a greedy run of `prompt` alone in the pool (never preempted)
    makes of it, but for near-ties: each token is the pick of such a run from the same text
    before it, or, at NEAR_TIES places at most, a token as likely as that pick within MARGIN.
    (Sharing the buffer changes a sequence's logits a little, so a pick between two
    near-equal tokens may flip: README, KV pool. A resume that lost or misplaced its KV
    disagrees with the alone run from then on, and by more.)"""
    from corral.runner.llama.native import token_bytes

    before = engine.status()["preemptions"]
    alone = _greedy(engine, prompt, len(generated))[0]
    same = next((i for i, (a, b) in enumerate(zip(alone, generated)) if a != b),
                len(generated))
    flips = []
    for i in range(same, len(generated)):  # from the first difference, token by token
        _, [pick] = _greedy(engine, prompt + generated[:i], 1, logprobs=5)
        mine = tuple(token_bytes(engine.llama.vocab, generated[i]))
        if pick.bytes != mine:
            rivals = [t.logprob for t in pick.top if t.bytes == mine]
            assert rivals and pick.logprob - rivals[0] < MARGIN, (i, pick, mine)
            flips.append(i)
    assert len(flips) <= NEAR_TIES, flips
    assert engine.status()["preemptions"] == before  # alone, so never preempted


def _greedy(engine: Any, prompt: list[int], n: int,
            logprobs: int = -1) -> tuple[list[int], list[Any]]:
    """A greedy run's tokens and logprobs."""
    job = engine.submit(Job(prompt=prompt, num_predict=n, ignore_eos=True, logprobs=logprobs,
                            params=SamplingParams(temperature=0)))
    tokens, stats = drain(job)
    return list(stats.context[-n:]), [lp for t in tokens for lp in t.logprobs]


@pytest.mark.model
def test_pool_serves_one_request_alone_like_any_engine(pooled: Any) -> None:
    job = pooled.submit(Job(prompt=pooled.tokenize("The capital of France is"), num_predict=12,
                            params=SamplingParams(temperature=0)))
    pieces, stats = collect(job)
    assert stats.eval_count == len(stats.context) - stats.prompt_tokens
    assert "".join(pieces) == pooled.detokenize(stats.context[stats.prompt_tokens:])


def test_daemon_in_pool_mode_counts_preemptions(daemon_factory: Any, starter_store: Any) -> None:
    import httpx

    from corral.registry.starter import CHAT_NAME

    # Without speculative decoding: these looping stories are drafted and kept a few
    # dozen tokens a step, so each would end before the next request arrived, and three
    # must run at once to overflow the pool.
    d = daemon_factory(starter_store, NUM_PARALLEL="0", KV_POOL="1", KV_POOL_TOKENS="256",
                       MAX_SLOTS="3", CONTEXT_LENGTH="192", SPECULATIVE="off")
    results: list[tuple[list[str], dict[str, Any]]] = []

    def client(word: str) -> None:
        pieces, last = [], {}
        with httpx.stream("POST", d.url + "/v1/completions", timeout=300, json={
                "model": CHAT_NAME, "prompt": f"A long story about a {word}:", "stream": True,
                "max_tokens": N, "temperature": 0, "ignore_eos": True,
                "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    import json

                    chunk = json.loads(line[6:])
                    if chunk["choices"]:
                        pieces.append(chunk["choices"][0]["text"])
                    if chunk.get("usage"):
                        last = chunk["usage"]
        results.append((pieces, last))

    threads = [threading.Thread(target=client, args=(w,)) for w in ("cat", "ship", "tree")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 3
    for pieces, usage in results:
        assert usage["completion_tokens"] == N
        assert sum(1 for p in pieces if p) <= N  # a piece per token at most: none repeated
    metrics = httpx.get(d.url + "/metrics").text
    line = next(ln for ln in metrics.splitlines() if ln.startswith("corral_preemptions_total{"))
    assert float(line.split()[-1]) > 0
    slots = next(ln for ln in metrics.splitlines() if ln.startswith("corral_slots{"))
    assert float(slots.split()[-1]) == 3


def test_sixteen_clients_all_run_at_once_with_defaults(daemon_factory: Any,
                                                       starter_store: Any) -> None:
    """Default mode sizes slots by memory (16 here), so c=16 meets no queue and no 503."""
    import httpx

    from corral.registry.starter import STARTER_NAME

    d = daemon_factory(starter_store, NUM_PARALLEL="0")  # auto, as shipped
    statuses: list[int] = []
    start = threading.Barrier(16)

    def client(i: int) -> None:
        start.wait()
        r = httpx.post(d.url + "/api/generate", timeout=300, json={
            "model": STARTER_NAME, "prompt": f"Item {i}:", "stream": False,
            "options": {"num_predict": 4, "temperature": 0}})
        statuses.append(r.status_code)

    httpx.post(d.url + "/api/generate", timeout=300, json={"model": STARTER_NAME})  # load
    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert statuses == [200] * 16
    metrics = httpx.get(d.url + "/metrics").text
    slots = next(ln for ln in metrics.splitlines() if ln.startswith("corral_slots{"))
    assert float(slots.split()[-1]) == 16


@pytest.mark.model
def test_alone_in_the_pool_a_greedy_request_equals_the_default_engine(chat_gguf: Path) -> None:
    """What pool mode keeps exact: a sequence whose cells nobody else's surround. (A
    preempted one is recomputed into whatever cells are free among its neighbours', and
    can then differ in the last bits: README, pool mode.)"""
    from corral.runner.llama.context import EngineConfig
    from corral.runner.engine.engine import Engine

    outputs = []
    for config in (EngineConfig(n_slots=2, num_ctx=256, kv_pool=512, deterministic=True),
                   EngineConfig(n_slots=2, num_ctx=256, deterministic=True)):
        eng = Engine(str(chat_gguf), config)
        eng.start()
        try:
            job = eng.submit(Job(prompt=eng.tokenize("Write a long story about a cat."),
                                 num_predict=40, params=SamplingParams(temperature=0)))
            outputs.append("".join(collect(job)[0]))
        finally:
            eng.stop()
    assert outputs[0] == outputs[1]
