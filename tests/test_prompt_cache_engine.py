"""The prompt cache on the real model: a restored or shared prefix gives the same greedy
output as computing it, and what is counted as evaluated is what was evaluated.

The baselines come from an engine without the cache, where each prompt's prefix stays
in the slot that computed it: a restored or branched prefix is those KV bits, copied,
so with batch-invariant kernels (deterministic=True) the answers must be the same.
They are compared with a kept prefix rather than a prompt prefilled whole because
llama.cpp's CPU kernels give a row's logits in the last bits by the size of the chunk it
was prefilled in: 269 tokens then 11 is not always 280 at once, cache or not."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Iterator

import pytest

from corral.runner.cache.caches import PrefixCaches
from corral.runner.llama.context import EngineConfig
from corral.runner.cache.diskcache import DiskEntry, DiskTier, Read
from corral.runner.engine.engine import Engine
from corral.runner.jobs import Done, Job, SamplingParams, Token
from corral.runner.cache.promptcache import PromptCache
from tests.support import wait_for

pytestmark = pytest.mark.model

GREEDY = SamplingParams(temperature=0)
NUM_CTX = 1024
DOC_A = ("The river rises in the northern hills, where snow melts each spring and feeds a "
         "hundred small streams. ") * 12
DOC_B = ("A baker wakes before dawn, lights the oven, and shapes the dough that rose through "
         "the night into loaves. ") * 12


def config(**kw: object) -> EngineConfig:
    settings: dict = {"n_slots": 1, "num_ctx": NUM_CTX, "deterministic": True, **kw}
    return EngineConfig(**settings)


def collect(job: Job) -> tuple[str, dict]:
    pieces = []
    while True:
        event = job.events.get(timeout=300)
        if isinstance(event, Token):
            pieces.append(event.text)
        elif isinstance(event, Done):
            return "".join(pieces), event.stats
        else:
            raise AssertionError(event)


def ask(engine: Engine, prompt: list[int], n: int = 8) -> tuple[str, dict]:
    return collect(engine.submit(Job(prompt=list(prompt), params=GREEDY, num_predict=n)))


def cold_answer(gguf: Path, prompt: list[int]) -> tuple[str, dict]:
    """What an engine with nothing cached answers: the reference a restored prefix, or
    one refused, must give the same as."""
    cold = Engine(str(gguf), config())
    cold.start()
    try:
        return ask(cold, prompt)
    finally:
        cold.stop()


def turns(engine: Engine) -> dict[str, list[int]]:
    tok = engine.tokenize
    a1, b1 = tok(DOC_A + "Question: where does the river rise?"), tok(DOC_B + "Question: when?")
    more = tok(" Answer in one word. Then: what feeds it?", add_special=False)
    return {"a1": a1, "b1": b1, "a2": a1 + more, "b2": b1 + more}


@pytest.fixture(scope="module")
def baseline(starter_gguf: Path) -> Iterator[dict[str, str]]:
    """Each prompt's greedy answer on one slot without the cache, in an order where each
    second turn finds its first turn's prefix kept in the slot: a1, a1 again (all but its
    last token kept), a2, b1, b2."""
    engine = Engine(str(starter_gguf), config())
    engine.start()
    try:
        prompts = turns(engine)
        out = {"a1": ask(engine, prompts["a1"])[0], "a1 again": ask(engine, prompts["a1"])[0]}
        out.update({name: ask(engine, prompts[name])[0] for name in ("a2", "b1", "b2")})
        yield out
    finally:
        engine.stop()


def test_alternating_conversations_restore_their_prompts(starter_gguf: Path,
                                                         baseline: dict[str, str]) -> None:
    engine = Engine(str(starter_gguf), config(cache_ram=256 << 20))
    engine.start()
    try:
        prompts = turns(engine)
        answers = {}
        evaluated = {}
        for name in ("a1", "b1", "a2", "b2"):  # one slot: each turn evicts the other
            answers[name], stats = ask(engine, prompts[name])
            evaluated[name] = stats.prompt_eval_count
        status = engine.status()
    finally:
        engine.stop()
    assert answers == {n: baseline[n] for n in answers}
    # The second turns prefill only what the first turns did not hold.
    assert evaluated["a2"] == len(prompts["a2"]) - len(prompts["a1"])
    assert evaluated["b2"] == len(prompts["b2"]) - len(prompts["b1"])
    assert status["cache_hits"] == 2
    assert status["cache_tokens_restored"] == len(prompts["a1"]) + len(prompts["b1"])
    assert 0 < status["cache_bytes"] <= 256 << 20 and status["cache_entries"] >= 1


def test_a_short_prompt_sent_again_comes_back_from_ram(starter_gguf: Path) -> None:
    """A prompt of the cache's least entry and one token, sent again after another took
    the one slot: its 32 tokens come back (llama-server's cache restores any prompt it
    keeps more of). Both start with BOS, which the slot's own cache shares."""
    engine = Engine(str(starter_gguf), config(cache_ram=256 << 20))
    engine.start()
    try:
        size = PromptCache(budget=1).min_tokens + 1
        a, b = engine.tokenize(DOC_A)[:size], engine.tokenize(DOC_B)[:size]
        assert a[0] == b[0] and a[1] != b[1]
        evaluated = [ask(engine, p, 2)[1].prompt_eval_count for p in (a, b, a)]
        status = engine.status()
    finally:
        engine.stop()
    assert evaluated == [size, size - 1, 1]  # b reuses the BOS; a's return reads one token
    assert status["cache_hits"] == 1 and status["cache_tokens_restored"] == size - 1


def test_an_idle_slot_is_copied_to_the_prompt_cache_at_rest_not_on_the_next_first_token(
        starter_gguf: Path, baseline: dict[str, str]) -> None:
    """Once an answer is out, rest copies the idle slot into the prompt cache (a 5 MB
    state was a millisecond of the next conversation's first token, its page faults two
    more): the placement that takes the slot then has nothing to copy, the copy made at
    rest is what the conversation comes back from, and the answers are the same."""
    engine = Engine(str(starter_gguf), config(cache_ram=256 << 20))
    engine.start()
    try:
        prompts = turns(engine)
        ram = engine.caches.ram
        ask(engine, prompts["a1"])
        wait_for(lambda: ram.lookup(prompts["a1"])[1] == len(prompts["a1"]), timeout=120)
        presaved = ram.lookup(prompts["a1"])[0]
        answers = {"b1": ask(engine, prompts["b1"])[0]}  # takes a1's slot
        entry, n = ram.lookup(prompts["a1"])
        assert entry is presaved and n == len(prompts["a1"])
        answers["a2"], stats = ask(engine, prompts["a2"])
    finally:
        engine.stop()
    assert stats.prompt_eval_count == len(prompts["a2"]) - len(prompts["a1"])
    assert answers == {name: baseline[name] for name in answers}


def burst(engine: Engine, names: list[str]) -> tuple[list[str], list[dict], dict]:
    prompts = turns(engine)
    jobs = [engine.submit(Job(prompt=list(prompts[n]), params=GREEDY, num_predict=8))
            for n in names]  # all queued before the engine thread starts
    engine.start()
    try:
        results = [collect(job) for job in jobs]
        return [text for text, _ in results], [s for _, s in results], engine.status()
    finally:
        engine.stop()


def test_requests_at_once_branch_from_the_one_computing_their_prefix(
        starter_gguf: Path, baseline: dict[str, str]) -> None:
    """Four slots, four requests with one document: the first prefills it, the others
    wait for that and branch from it; each answer is what it is alone."""
    engine = Engine(str(starter_gguf), config(n_slots=4))
    prompts = turns(engine)
    names = ["a1", "a2", "a1", "a2"]
    texts, stats, status = burst(engine, names)
    assert texts == [baseline[n] for n in ("a1", "a2", "a1 again", "a2")]
    n = len(prompts["a1"])
    assert [s.prompt_eval_count for s in stats] == [n, len(prompts["a2"]) - n, 1,
                                                       len(prompts["a2"]) - n]
    assert status["cache_tokens_shared"] == 3 * n - 1  # a prompt keeps one token to decode


def test_a_burst_at_an_idle_model_computes_its_shared_prefix_once(
        starter_gguf: Path, baseline: dict[str, str]) -> None:
    """Elastic KV holds one slot while idle: the burst waits for the shared prefix while
    the context grows, however the two race, and never computes it twice."""
    engine = Engine(str(starter_gguf), config(n_slots=4, start_slots=1))
    prompts = turns(engine)
    names = ["a1", "a2", "a1", "a2"]
    texts, stats, _ = burst(engine, names)
    assert texts == [baseline[n] for n in ("a1", "a2", "a1 again", "a2")]
    computed = sum(s.prompt_eval_count for s in stats)
    assert computed <= 1.2 * len(prompts["a2"]), computed  # a1 is a prefix of a2


def test_a_document_that_other_slots_hold_is_copied_out_once(starter_gguf: Path) -> None:
    """Four requests after one document differ in a short question. A slot taken from
    them copies nothing out while other slots hold the document; the last one to go is
    kept, once, and a later question after the document restores it."""
    engine = Engine(str(starter_gguf), config(n_slots=4, cache_ram=256 << 20))
    tok = engine.tokenize
    doc = tok(DOC_A)
    questions = [doc + tok(f" Question {i}: why?", add_special=False) for i in range(5)]
    jobs = [engine.submit(Job(prompt=list(q), params=GREEDY, num_predict=8))
            for q in questions[:4]]
    engine.start()
    try:
        for job in jobs:
            collect(job)
        entries = []
        for day in ("Monday", "Tuesday", "Wednesday", "Thursday"):  # each takes a slot
            ask(engine, tok(f"{day}. " + DOC_B))
            entries.append(engine.status()["cache_entries"])
        _, stats = ask(engine, questions[4])
        status = engine.status()
    finally:
        engine.stop()
    assert entries == [0, 0, 0, 1]
    assert status["cache_hits"] == 1 and stats.prompt_eval_count < 16


def test_the_disk_tier_keeps_a_prompt_across_a_restart(starter_gguf: Path, tmp_path: Path,
                                                       baseline: dict[str, str]) -> None:
    disk = {"cache_disk": 512 << 20, "cache_dir": str(tmp_path)}
    first = Engine(str(starter_gguf), config(cache_ram=64 << 20, **disk))
    first.start()
    prompts = turns(first)
    assert ask(first, prompts["a1"])[0] == baseline["a1"]
    first.stop()  # an unload: what the slot held is written to disk
    second = Engine(str(starter_gguf), config(cache_ram=64 << 20, **disk))
    second.start()
    try:
        text, stats = ask(second, prompts["a2"])
    finally:
        second.stop()
    assert text == baseline["a2"]
    assert stats.prompt_eval_count == len(prompts["a2"]) - len(prompts["a1"])
    # Another KV type is another key: nothing is restored across it.
    third = Engine(str(starter_gguf), config(cache_ram=64 << 20, kv_cache_type="q8_0", **disk))
    third.start()
    try:
        _, stats = ask(third, prompts["a2"])
    finally:
        third.stop()
    assert stats.prompt_eval_count == len(prompts["a2"])


class HeldReader:
    """The disk tier's reader, held until the test releases it (a seam of Engine's)."""

    def __init__(self, held: bool = True) -> None:
        self.started, self.release = threading.Event(), threading.Event()
        if not held:
            self.release.set()
        self.threads: list[str] = []

    def __call__(self, tier: DiskTier, entry: DiskEntry) -> Read:
        self.threads.append(threading.current_thread().name)
        self.started.set()
        assert self.release.wait(300)
        return tier.read(entry)


def on_disk(starter_gguf: Path, tmp_path: Path) -> tuple[dict, dict[str, list[int]]]:
    """The settings of a disk tier that holds a1's prefix (written at an unload)."""
    disk = {"cache_ram": 64 << 20, "cache_disk": 512 << 20, "cache_dir": str(tmp_path)}
    first = Engine(str(starter_gguf), config(**disk))
    first.start()
    prompts = turns(first)
    try:
        ask(first, prompts["a1"])
    finally:
        first.stop()
    assert len(list(tmp_path.glob("*/*.kv"))) == 1
    return disk, prompts


def test_other_slots_decode_while_a_prefix_is_read_from_disk(
        starter_gguf: Path, tmp_path: Path, baseline: dict[str, str]) -> None:
    disk, prompts = on_disk(starter_gguf, tmp_path)
    reader = HeldReader()
    engine = Engine(str(starter_gguf), config(n_slots=2, **disk), disk_reader=reader)
    engine.start()
    try:
        other = engine.submit(Job(prompt=list(prompts["b1"]), params=GREEDY, num_predict=400,
                                  ignore_eos=True))
        assert isinstance(other.events.get(timeout=300), Token)
        job = engine.submit(Job(prompt=list(prompts["a2"]), params=GREEDY, num_predict=8))
        assert reader.started.wait(300)
        while not other.events.empty():  # what came before this point proves nothing
            other.events.get_nowait()
        for _ in range(10):  # each made while the read is held
            assert isinstance(other.events.get(timeout=300), Token)
        assert job.events.empty()  # it waits for its prefix, not for the others
        reader.release.set()
        text, stats = collect(job)
        other.cancel()
        collect(other)
        status = engine.status()
    finally:
        engine.stop()
    assert reader.threads == ["disk-read"]
    assert text == baseline["a2"]  # the restored prefix, bit for bit
    assert stats.prompt_eval_count == len(prompts["a2"]) - len(prompts["a1"])
    assert status["cache_hits"] == 1 and status["cache_tokens_restored"] == len(prompts["a1"])


def test_a_corrupt_entry_read_off_the_engine_thread_gives_the_cold_answer(
        starter_gguf: Path, tmp_path: Path) -> None:
    disk, prompts = on_disk(starter_gguf, tmp_path)
    [path] = tmp_path.glob("*/*.kv")
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # inside the state: the header still parses
    path.write_bytes(bytes(raw))
    reader = HeldReader(held=False)
    engine = Engine(str(starter_gguf), config(**disk), disk_reader=reader)
    engine.start()
    try:
        text, stats = ask(engine, prompts["a2"])
        assert engine.caches.disk is not None and engine.caches.disk.rejected == 1
    finally:
        engine.stop()
    cold_text, cold_stats = cold_answer(starter_gguf, prompts["a2"])
    assert reader.threads == ["disk-read"]
    assert text == cold_text and stats.prompt_eval_count == cold_stats.prompt_eval_count \
        == len(prompts["a2"])


def test_a_request_waiting_for_its_read_can_be_cancelled(starter_gguf: Path,
                                                          tmp_path: Path) -> None:
    disk, prompts = on_disk(starter_gguf, tmp_path)
    reader = HeldReader()
    engine = Engine(str(starter_gguf), config(**disk), disk_reader=reader)
    engine.start()
    try:
        job = engine.submit(Job(prompt=list(prompts["a2"]), params=GREEDY, num_predict=8))
        assert reader.started.wait(300)
        job.cancel()
        event = job.events.get(timeout=300)  # while the read is still held
        assert isinstance(event, Done) and event.stats.done_reason == "cancel"
        assert engine.status()["waiting"] == 0
        reader.release.set()
        _, stats = ask(engine, prompts["a2"])  # the next one reads it again, whole
    finally:
        engine.stop()
    assert stats.prompt_eval_count == len(prompts["a2"]) - len(prompts["a1"])


def test_a_held_disk_write_does_not_hold_the_engine(starter_gguf: Path, tmp_path: Path) -> None:
    """The disk tier writes on its own thread: with the write held by a gate, the next
    request decodes to its end; then the write lands."""
    from tests.support import wait_for

    gate = threading.Event()
    disk = DiskTier(tmp_path, 512 << 20, "space", background=True, gate=gate)
    engine = Engine(str(starter_gguf), config(), caches=PrefixCaches(PromptCache(0), disk))
    engine.start()

    def files() -> list[Path]:
        return list((tmp_path / "space").glob("*.kv"))

    try:
        prompts = turns(engine)
        ask(engine, prompts["a1"])
        _, stats = ask(engine, prompts["b1"])  # a1's state leaves the slot for the disk
        assert stats.eval_count == 8 and files() == []  # decoded while its write is held
        gate.set()
        wait_for(lambda: len(files()) == 1, timeout=120)
    finally:
        gate.set()
        engine.stop()  # (b1's state is written too, and the writer waited for)
    assert [e.tokens[:len(prompts["a1"])] for e in disk.entries
            if e.tokens[:len(prompts["a1"])] == tuple(prompts["a1"])] == [tuple(prompts["a1"])]


def test_a_state_llama_cpp_refuses_is_prefilled_whole_at_the_next_step(
        starter_gguf: Path) -> None:
    # The plan's rows assumed the restored prefix: run skips that step's decode, the slot
    # goes back to prefill its whole prompt, and the entry is dropped as refused.
    ram = PromptCache(budget=1 << 20)
    engine = Engine(str(starter_gguf), config(), caches=PrefixCaches(ram))
    engine.start()
    try:
        prompts = turns(engine)
        ram.add(prompts["a1"], b"not a state at all")
        text, stats = ask(engine, prompts["a2"])
        assert ram.entries == [] and engine.status()["cache_hits"] == 0
    finally:
        engine.stop()
    cold_text, _ = cold_answer(starter_gguf, prompts["a2"])
    assert text == cold_text and stats.prompt_eval_count == len(prompts["a2"])
