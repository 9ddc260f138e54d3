"""The engine with the real starter model: batching, reuse, sampling, limits, cancel."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import llama_cpp as L
import pytest

from corral.runner.llama.context import EngineConfig
from corral.errors import ContextOverflow
from corral.runner.engine.engine import Engine
from corral.runner.engine.plan import StepPlan
from corral.runner.jobs import Done, Failed, Job, SamplingParams, Token
from tests.support import embed

pytestmark = pytest.mark.model  # llama.cpp runs in every test here

GREEDY = SamplingParams(temperature=0)
PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea,",
           "def fibonacci(n):", "The quick brown fox"]


class Steps:
    """The jobs in each step's batch, recorded on the engine thread through the Engine's
    step_hook seam; a test may also hold the engine before a step of its choosing."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.batches: list[list[Job]] = []
        self._hold: Callable[[list[Job]], bool] | None = None
        self.held, self.go = threading.Event(), threading.Event()

    def __call__(self, plan: StepPlan) -> None:
        jobs = [slot.job for slot in plan.slots if slot.job is not None]
        with self.lock:
            self.batches.append(jobs)
            hold = self._hold is not None and self._hold(jobs)
            if hold:
                self._hold = None
        if hold:
            self.held.set()
            self.go.wait(60)  # never for good, should the test fail meanwhile

    def hold_before(self, when: Callable[[list[Job]], bool]) -> None:
        """Hold the engine before the next step whose batch `when` accepts, until `go`."""
        self.held.clear()
        self.go.clear()
        with self.lock:
            self._hold = when

    def __len__(self) -> int:
        with self.lock:
            return len(self.batches)

    def since(self, mark: int) -> list[list[Job]]:
        with self.lock:
            return self.batches[mark:]


@pytest.fixture(scope="module")
def steps() -> Steps:
    return Steps()


@pytest.fixture(scope="module")
def engine(starter_gguf: Path, steps: Steps) -> Iterator[Engine]:
    # Batch-invariant kernels: these tests compare greedy output alone and batched.
    eng = Engine(str(starter_gguf), EngineConfig(n_slots=4, num_ctx=512, deterministic=True),
                 step_hook=steps)
    eng.start()
    yield eng
    steps.go.set()
    eng.stop()


def collect(job: Job, timeout: float = 120) -> tuple[list[str], str, Any]:
    """The streamed pieces, then "done" with its stats or "error" with the error."""
    pieces = []
    while True:
        event = job.events.get(timeout=timeout)
        if isinstance(event, Token):
            pieces.append(event.text)
        elif isinstance(event, Done):
            return pieces, "done", event.stats
        else:
            assert isinstance(event, Failed)
            return pieces, "error", event.error


def run(engine: Engine, prompt: str, n: int = 20, **kw: Any) -> tuple[str, dict]:
    kw.setdefault("params", GREEDY)
    job = engine.submit(Job(prompt=engine.tokenize(prompt), num_predict=n, **kw))
    pieces, kind, value = collect(job)
    assert kind == "done", value
    return "".join(pieces), value


def run_together(engine: Engine, specs: list[tuple[str, int, dict]]) -> list[str]:
    results: list[str] = [""] * len(specs)

    def worker(i: int) -> None:
        prompt, n, kw = specs[i]
        results[i] = run(engine, prompt, n, **kw)[0]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(specs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def run_at_once(engine: Engine, steps: Steps, specs: list[tuple[str, int]]) -> list[str]:
    """Greedy runs submitted while the engine holds its first step, so they start
    together; returns their texts once it is shown that one step decoded them all."""
    mark = len(steps)
    steps.hold_before(lambda batch: True)
    jobs: list[Job] = []
    for prompt, n in specs:
        jobs.append(engine.submit(Job(prompt=engine.tokenize(prompt), num_predict=n,
                                      params=GREEDY)))
        if len(jobs) == 1:
            assert steps.held.wait(60)  # the first is in a step; the others join the next
    steps.go.set()
    results = [collect(job) for job in jobs]
    assert all(kind == "done" for _, kind, _ in results), results
    assert any(all(any(j is job for j in batch) for job in jobs)
               for batch in steps.since(mark)), "the requests never shared a step"
    return ["".join(pieces) for pieces, _, _ in results]


def test_no_cross_talk_between_slots(engine: Engine, steps: Steps) -> None:
    lengths = [12, 30, 20, 25]
    alone = [run(engine, p, n)[0] for p, n in zip(PROMPTS, lengths)]
    for _ in range(2):  # and again once every slot has been reused
        together = run_at_once(engine, steps, list(zip(PROMPTS, lengths)))
        assert together == alone
    rotated = run_at_once(engine, steps, list(zip(PROMPTS[1:] + PROMPTS[:1],
                                                  lengths[1:] + lengths[:1])))
    assert rotated == alone[1:] + alone[:1]


def test_seeded_sampling_is_reproducible_whatever_the_batch(engine: Engine) -> None:
    seeded = {"params": SamplingParams(temperature=0.9, seed=42)}
    alone = run(engine, PROMPTS[1], 24, **seeded)[0]
    others = [(p, 30, {"params": SamplingParams(temperature=1.0)}) for p in PROMPTS[2:]]
    together = run_together(engine, [(PROMPTS[1], 24, seeded), *others])
    assert together[0] == alone
    assert run(engine, PROMPTS[1], 24, params=SamplingParams(temperature=0.9, seed=7))[0] != alone


def test_second_turn_prefills_only_new_tokens(engine: Engine) -> None:
    _, first = run(engine, "User: Tell me about the moon.\nAssistant:", 16)
    followup = engine.tokenize("\nUser: And the sun?\nAssistant:", add_special=False)
    job = engine.submit(Job(prompt=list(first.context) + followup, params=GREEDY,
                            num_predict=8))
    _, kind, second = collect(job)
    assert kind == "done"
    # The first turn's last sampled token was never decoded, so it is new too.
    assert second.prompt_eval_count == len(followup) + 1
    assert second.prompt_tokens == len(first.context) + len(followup)


def test_stop_string_spanning_tokens_is_never_emitted(engine: Engine) -> None:
    full, _ = run(engine, PROMPTS[0], 24)
    pieces_job = engine.submit(Job(prompt=engine.tokenize(PROMPTS[0]), params=GREEDY,
                                   num_predict=24))
    pieces, _, _ = collect(pieces_job)
    # A stop string that starts inside one piece and ends inside a later one.
    start = len(pieces[0]) + len(pieces[1]) - 2
    stop = full[start:start + 6]
    assert len(stop) == 6
    text, stats = run(engine, PROMPTS[0], 24, stop=[stop])
    assert text == full[: full.index(stop)]
    assert stats.done_reason == "stop"


def test_utf8_output_is_never_split(engine: Engine) -> None:
    job = engine.submit(Job(prompt=engine.tokenize("한국어 문장: 안녕하세요, 오늘은 🎉"),
                            params=GREEDY, num_predict=40))
    pieces, kind, _ = collect(job)
    assert kind == "done"
    text = "".join(pieces)
    assert any("\uac00" <= ch <= "\ud7a3" for ch in text) or any(ord(ch) > 0xFFFF for ch in text)
    assert "\ufffd" not in text


def test_cancel_frees_the_slot_within_two_steps(engine: Engine, steps: Steps) -> None:
    job = Job(prompt=engine.tokenize(PROMPTS[1]), params=GREEDY, num_predict=400)
    taken = [0]

    def seventh(batch: list[Job]) -> bool:  # after its prompt's step and five tokens
        taken[0] += any(j is job for j in batch)
        return taken[0] == 7

    steps.hold_before(seventh)
    engine.submit(job)
    assert steps.held.wait(60)  # the engine waits before the job's seventh step
    mark = len(steps) - 1  # that step: planned already, it runs
    job.cancel()
    steps.go.set()
    _, kind, value = collect(job, timeout=60)
    assert kind == "done" and value.done_reason == "cancel"
    assert sum(any(j is job for j in batch) for batch in steps.since(mark)) <= 2
    assert engine.status()["busy_slots"] == 0


def test_long_prompt_truncates_or_errors(engine: Engine) -> None:
    long_prompt = "one two three four " * 200
    job = engine.submit(Job(prompt=engine.tokenize(long_prompt), params=GREEDY, num_predict=4,
                            truncate=False))
    assert collect(job)[1] == "error"
    text, stats = run(engine, long_prompt, 4)
    assert stats.prompt_tokens < 512 and stats.eval_count == 4


def test_context_shift_or_length(starter_gguf: Path) -> None:
    eng = Engine(str(starter_gguf), EngineConfig(n_slots=1, num_ctx=64))
    eng.start()
    try:
        _, shifted = run(eng, PROMPTS[1], 100)
        assert shifted.eval_count == 100 and shifted.done_reason == "length"
        _, unshifted = run(eng, PROMPTS[1], 100, shift=False)
        assert unshifted.done_reason == "length" and unshifted.eval_count < 64
        _, filled = run(eng, PROMPTS[1], -2)
        assert filled.prompt_tokens + filled.eval_count == 64
    finally:
        eng.stop()


def test_json_grammar_constrains_output(engine: Engine) -> None:
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
              "required": ["city"], "additionalProperties": False}
    grammar = json_schema_to_gbnf(json.dumps(schema))
    text, stats = run(engine, "The capital of France as JSON:", 40, grammar=grammar)
    assert isinstance(json.loads(text)["city"], str)
    assert stats.done_reason == "stop"


def test_embeddings(engine: Engine) -> None:
    [a, b] = embed(engine, [engine.tokenize("hello world"), engine.tokenize("goodbye")])
    assert len(a) == len(b) == 640 and a != b
    with pytest.raises(ContextOverflow):
        embed(engine, [engine.tokenize("word " * 600)], truncate=False)
    assert len(embed(engine, [engine.tokenize("word " * 600)])[0]) == 640


def test_embedding_context_is_sized_to_its_inputs(starter_gguf: Path) -> None:
    eng = Engine(str(starter_gguf), EngineConfig(n_slots=1, num_ctx=2048))
    eng.start()
    try:
        short = eng.tokenize("hello world")
        [first] = embed(eng, [short])
        assert eng.embed_ctx.capacity == 512  # not num_ctx: its KV grows with its inputs
        embed(eng, [eng.tokenize("word " * 700)])
        assert eng.embed_ctx.capacity == 1024
        embed(eng, [eng.tokenize("word " * 5000)])  # truncated to num_ctx
        assert eng.embed_ctx.capacity == 2048
        [again] = embed(eng, [short])
        assert again == first  # the context's size does not change the vector
    finally:
        eng.stop()


def test_a_grammar_that_does_not_parse_fails_its_request_alone(engine: Engine) -> None:
    from corral.errors import InvalidOption

    prompt = engine.tokenize(PROMPTS[0])
    other = engine.submit(Job(prompt=list(prompt), params=GREEDY, num_predict=8))
    bad = engine.submit(Job(prompt=engine.tokenize(PROMPTS[1]), params=GREEDY, num_predict=8,
                            grammar="root ::= [a-z"))
    _, kind, error = collect(bad)
    assert kind == "error" and isinstance(error, InvalidOption)
    pieces, kind, _ = collect(other)
    assert kind == "done" and "".join(pieces) == run(engine, PROMPTS[0], 8)[0]


def test_ignore_eos_finds_its_end_tokens_on_the_submitting_thread(starter_gguf: Path) -> None:
    """ignore_eos bans every end-of-generation token, which takes a scan of the whole
    vocabulary (0.1 s for gemma3's 262,144). Run inside a step, it would hold every stream
    in the batch; the engine thread is never started here, so only submit can have run it."""
    eng = Engine(str(starter_gguf), EngineConfig(n_slots=1, num_ctx=128))
    try:
        assert eng.llama._eog is None  # nothing has asked yet
        eng.submit(Job(prompt=[2, 651], num_predict=1))
        assert eng.llama._eog is None  # a request that keeps its end tokens needs no scan
        eng.submit(Job(prompt=[2, 651], num_predict=1, ignore_eos=True))
        assert eng.llama._eog and eng.llama.eog_tokens() == eng.llama._eog
        assert all(L.llama_vocab_is_eog(eng.llama.vocab, t) for t in eng.llama._eog)
    finally:
        eng.stop()


def test_a_burst_of_ignore_eos_submits_scans_the_vocabulary_once(
        starter_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sixteen ignore_eos requests submitted at once, each scanning the vocabulary under
    the GIL, held a fresh daemon's first burst 6-7 s before its first step."""
    calls: list[int] = []
    is_eog = L.llama_vocab_is_eog
    monkeypatch.setattr(L, "llama_vocab_is_eog",
                        lambda vocab, t: calls.append(t) or is_eog(vocab, t))
    eng = Engine(str(starter_gguf), EngineConfig(n_slots=4, num_ctx=128))
    try:
        gate = threading.Barrier(4)

        def submit() -> None:
            gate.wait(timeout=60)
            eng.submit(Job(prompt=[2, 651], num_predict=1, ignore_eos=True))
        threads = [threading.Thread(target=submit) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads)
        assert len(calls) == eng.llama.n_vocab  # one scan, however many asked at once
    finally:
        eng.stop()
