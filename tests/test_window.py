"""A sliding-window model on the engine with a cache of the window's size (llama-server's
default, --swa-full off), a tiny random Gemma 3 the tests write (tests/window_model.py,
a window of 16 tokens). Such a cache overwrites the KV of positions that left the
window once its ring comes round, so a state longer than the window is cut back within
a window of its end (checked), or at a checkpoint (the window's KV read where a later
prompt is likely to branch), or reused whole; a shorter one is cut anywhere. The
answers are a full-size cache's and llama.cpp's own loop's, with batch-invariant
kernels."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from corral.runner.engine.engine import Engine
from corral.runner.jobs import Done, ImageSpan, Job, SamplingParams, Token
from corral.runner.llama.context import CHECKPOINTS, EngineConfig, LlamaContext
from corral.runner.prefix import Cuts
from tests.support import FlatCost, collect, greedy, llama_cpp_greedy, started, wait_for
from tests.window_model import WINDOW

PROMPT = ("Once upon a time there was a fox who lived in the forest near the river, "
          "and every morning it went down to the water to drink, while the birds sang in "
          "the tall trees above and the fish swam past in the cold clear stream")
GRAMMAR = ('root ::= ("The " ("red" | "blue" | "green" | "old" | "big") " " '
           '("fox" | "cat" | "dog") " jumps over the lazy dog. ")+')


@pytest.fixture(scope="module")
def window_gguf(chat_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.window_model import write_window

    return write_window(chat_gguf, tmp_path_factory.mktemp("window") / "gemma3.gguf", seed=1)


def config(**kw: Any) -> EngineConfig:
    return EngineConfig(**{"n_slots": 1, "num_ctx": 2048, "n_batch": 64, "deterministic": True,
                           "swa_full": False, **kw})


@pytest.fixture(scope="module")
def engines(window_gguf: Path) -> Iterator[dict[str, Engine]]:
    """The window cache with speculation on and off, and a full-size cache to compare."""
    made = {"window": Engine(str(window_gguf), config(), cost=FlatCost()),
            "plain": Engine(str(window_gguf), config(speculative=False)),
            "full": Engine(str(window_gguf), config(swa_full=True))}
    yield from started(made)


run = greedy


def same_output(a: tuple[list[Token], Done], b: tuple[list[Token], Done]) -> None:
    """One output: the same tokens, counts and end, and the same logprobs to a part in a
    thousand. Not to the bit: a window cache's ring puts a sequence's cells in another
    order than a full-size cache does, and attention sums them in cell order (a few
    units in the fifth digit of a logprob of -141, seen here)."""
    assert a[1].stats.context == b[1].stats.context
    assert (a[1].stats.done_reason, a[1].stats.eval_count) == (b[1].stats.done_reason,
                                                               b[1].stats.eval_count)
    want = [(lp.token, top.token, top.logprob) for t in b[0] for lp in t.logprobs
            for top in lp.top]
    got = [(lp.token, top.token, pytest.approx(top.logprob, rel=1e-3, abs=1e-3))
           for t in a[0] for lp in t.logprobs for top in lp.top]
    assert got == want


def fresh(engine: Engine, tokens: list[int], **job: Any) -> tuple[list[Token], Done]:
    """`tokens` read whole: another prompt takes the slot first (nothing in common)."""
    other = engine.tokenize("Zebras", add_special=False)
    assert other[0] != tokens[0]
    run(engine, other, num_predict=1)
    out = run(engine, tokens, **job)
    assert out[1].stats.prompt_eval_count == len(tokens)
    return out


def test_the_cache_holds_the_window_and_its_slots_keep_checkpoints(
        engines: dict[str, Engine], window_gguf: Path) -> None:
    window, full = engines["window"].llama, engines["full"].llama
    assert window.window == WINDOW and window.cuts == Cuts(WINDOW, CHECKPOINTS)
    assert window.undo is None
    assert window.checkpoints == CHECKPOINTS and window.state_bytes > 0
    assert engines["window"].spec is not None  # speculation stays on
    assert full.window == 0 and full.cuts == Cuts() and full.checkpoints == 0
    # llama.cpp's cells of the window cache: the window's for each sequence and a batch
    assert window.cells_bytes() < full.cells_bytes()
    # By default the window's cache, beside a projector too (as llama-server's), but not
    # where exactness is promised, nor where the context is a few windows long (a
    # full-size cache costs little and cuts anywhere).
    auto = {}
    cases: list[dict[str, Any]] = [{}, {"deterministic": True}, {"num_ctx": 32},
                                   {"projector": "mmproj.gguf"}]
    for case in cases:
        llama = LlamaContext(str(window_gguf), EngineConfig(**{"num_ctx": 2048, **case}))
        auto[tuple(case)] = llama.window
        llama.free()
    assert auto == {(): WINDOW, ("deterministic",): 0, ("num_ctx",): 0,
                    ("projector",): WINDOW}


@pytest.mark.parametrize("spec", ["window", "plain"], ids=["drafting", "plain"])
def test_a_regenerate_reads_only_the_last_prompt_token(engines: dict[str, Engine],
                                                       spec: str) -> None:
    engine = engines[spec]
    prompt = engine.tokenize(PROMPT, add_special=True)
    assert len(prompt) > 2 * WINDOW
    first = fresh(engine, prompt, num_predict=24)
    same_output(first, fresh(engines["full"], prompt, num_predict=24))
    again = run(engine, prompt, num_predict=24)  # back to the checkpoint one token short
    assert again[1].stats.prompt_eval_count == 1
    same_output(again, first)


def settled(engine: Engine) -> int:
    """The engine's steps, once the step that delivered the last answer has ended (its
    cells taken back and checkpoints read after the answer went out)."""
    wait_for(lambda: engine.watch.running_for() == 0)
    return engine.steps


def test_a_short_tail_read_after_a_checkpoint_goes_in_one_step(
        engines: dict[str, Engine]) -> None:
    """A prompt placed past its slot's checkpoints has its state read where it starts; a
    tail shorter than MARK_SPACING after that is read in the same step as its last token
    (a stop before the last token would read no checkpoint there: one it is reading is
    too close), so a burst of such prompts pays no extra step of every stream's rows."""
    engine = engines["plain"]
    prompt = engine.tokenize(PROMPT, add_special=True)
    fresh(engine, prompt, num_predict=1)
    tail = engine.tokenize(" the fox", add_special=False)[:2]
    steps = settled(engine)
    out = run(engine, prompt[:-3] + tail, num_predict=1)
    assert out[1].stats.prompt_eval_count == len(tail)
    assert settled(engine) - steps == 1
    slot = next(s for s in engine.slots if s.cached[:len(prompt) - 3] == prompt[:-3])
    assert len(prompt) - 3 in [at for at, _ in slot.checkpoints]  # read where it started


def test_a_sequence_that_stays_within_the_window_reads_no_checkpoint(
        engines: dict[str, Engine]) -> None:
    """A prompt whose tokens and the most it may generate fit the window is never
    overwritten by the cache's ring, so it is cut anywhere: it reads no checkpoint, and
    its prefill goes in one step (a stop a token short for one would cost a step of
    every stream's rows). One that may generate past the window reads one."""
    engine = engines["plain"]
    prompt = engine.tokenize("Once upon a time", add_special=True)
    short = WINDOW - len(prompt) - 1
    assert short > 2
    steps = settled(engine)
    first = fresh(engine, prompt, num_predict=short)
    slot = next(s for s in engine.slots if s.cached[:len(prompt)] == prompt)
    assert slot.checkpoints == []
    assert settled(engine) - steps == 1 + short  # the other chat's one, then one a token
    again = run(engine, prompt, num_predict=short)
    assert again[1].stats.prompt_eval_count == 1
    same_output(again, first)
    fresh(engine, prompt, num_predict=2 * WINDOW)
    slot = next(s for s in engine.slots if s.cached[:len(prompt)] == prompt)
    assert [at for at, _ in slot.checkpoints] == [len(prompt) - 1]


def test_an_edited_last_message_goes_back_to_the_turn_before(
        engines: dict[str, Engine]) -> None:
    engine = engines["window"]
    tokenize = engine.tokenize
    turn1 = tokenize(PROMPT, add_special=True)
    reply = list(run(engine, turn1, num_predict=12)[1].stats.context)[len(turn1):]
    history = turn1 + reply
    asked = run(engine, history + tokenize(" Tell me more about the fox.", add_special=False),
                num_predict=12)
    assert asked[1].stats.prompt_eval_count < asked[1].stats.prompt_tokens  # the turn kept
    edited = history + tokenize(" Tell me about the dog instead.", add_special=False)
    out = run(engine, edited, num_predict=12)
    assert out[1].stats.prompt_eval_count <= len(edited) - len(history) + 1
    same_output(out, fresh(engines["full"], edited, num_predict=12))


def test_a_chat_with_an_image_goes_back_to_a_checkpoint_never_inside_the_image(
        engines: dict[str, Engine]) -> None:
    """A Gemma 3 image (its tokens attend both ways: decoded whole) between two texts
    past the window. The checkpoint a batch before the prompt's end falls inside the
    image and is read where the image starts; one token before the end is read too. A
    regenerate reads one token; a prompt that changes the text after the image goes
    back to the image's start and reads it and its own text; each answer is a full-size
    cache's."""
    engine = engines["window"]
    head = engine.tokenize(PROMPT, add_special=True)
    tail = engine.tokenize(" " + PROMPT + " " + PROMPT, add_special=False)[:50]
    other = engine.tokenize(" and then the fox went home to sleep " + PROMPT,
                            add_special=False)[:50]
    n_image = 16
    embd = np.random.default_rng(3).normal(0, 1, (n_image, 64)).astype(np.float32)
    image = ImageSpan(start=len(head), key=-7, embd=embd, non_causal=True)
    prompt = head + [image.key] * n_image + tail
    assert image.start < len(prompt) - 1 - config().n_batch < image.end  # the moved one
    job = {"num_predict": 12, "images": (image,)}
    first = fresh(engine, prompt, **job)
    same_output(first, fresh(engines["full"], prompt, **job))
    slot = next(s for s in engine.slots if s.cached[:len(prompt)] == prompt)
    assert sorted(at for at, _ in slot.checkpoints) == [image.start, len(prompt) - 1]
    again = run(engine, prompt, **job)
    assert again[1].stats.prompt_eval_count == 1
    same_output(again, first)
    edited = head + [image.key] * n_image + other
    out = run(engine, edited, **job)
    assert out[1].stats.prompt_eval_count == n_image + len(other)
    same_output(out, fresh(engines["full"], edited, **job))


def test_a_state_past_the_window_is_cut_near_its_end_or_back_at_a_checkpoint(
        engines: dict[str, Engine]) -> None:
    """The slot holds a prompt longer than llama.cpp's window cache (a window a sequence
    and a batch, in 256s: its ring has come round) and what it generated. A prompt that
    keeps all but its last three tokens is cut there: the KV of the window before the
    cut is still in the ring, which is checked. One that keeps less than a window from
    the end goes back to the checkpoint one token before the first prompt's end."""
    engine = engines["window"]
    prompt = engine.tokenize(" ".join([PROMPT] * 8), add_special=True)
    assert len(prompt) > 256 + 2 * WINDOW + engine.llama.n_batch
    tokens = list(run(engine, prompt, num_predict=40)[1].stats.context)
    near = tokens[:-3] + engine.tokenize(" and the", add_special=False)
    out = run(engine, near, num_predict=16)
    assert out[1].stats.prompt_eval_count == len(near) - (len(tokens) - 3)
    same_output(out, fresh(engines["full"], near, num_predict=16))
    tokens = list(run(engine, prompt, num_predict=40)[1].stats.context)
    far = tokens[:len(prompt) + 5] + engine.tokenize(" and the", add_special=False)
    assert len(tokens) - 1 - (len(prompt) + 5) >= WINDOW
    out = run(engine, far, num_predict=16)
    assert out[1].stats.prompt_eval_count == len(far) - (len(prompt) - 1)
    same_output(out, fresh(engines["full"], far, num_predict=16))


def test_a_state_shorter_than_the_window_is_cut_anywhere(engines: dict[str, Engine]) -> None:
    engine = engines["window"]
    short = engine.tokenize("Mountains rise above", add_special=True)
    held = list(run(engine, short, num_predict=4)[1].stats.context)
    assert len(held) < WINDOW
    part = held[:-2] + engine.tokenize(" the valley", add_special=False)
    out = run(engine, part, num_predict=8)
    assert out[1].stats.prompt_eval_count == len(part) - (len(held) - 2)
    same_output(out, fresh(engines["full"], part, num_predict=8))


def test_the_window_check_sees_kv_the_ring_overwrote(window_gguf: Path) -> None:
    """In a context of one stream, a sequence that read 400 tokens has had its ring of
    256 cells come round: cut back to 100 it lacks the window before, cut to 390 it
    holds it; in a context of two streams the same."""
    import llama_cpp as L

    from corral.runner.llama.partial import Window

    model = L.llama_model_load_from_file(str(window_gguf).encode(),
                                         L.llama_model_default_params())
    try:
        window = Window.measured(model, 2, WINDOW)
        for streams in (1, 2):
            params = L.llama_context_default_params()
            params.n_ctx, params.n_batch, params.n_ubatch = 1024 * streams, 64, 64
            params.n_seq_max, params.kv_unified, params.swa_full = streams, False, False
            ctx = L.llama_init_from_model(model, params)
            try:
                batch = L.llama_batch_init(64, 0, 1)
                for start in range(0, 400, 64):
                    n = min(64, 400 - start)
                    batch.n_tokens = n
                    for i in range(n):
                        batch.token[i], batch.pos[i] = 100 + (start + i) % 50, start + i
                        batch.n_seq_id[i], batch.seq_id[i][0] = 1, 0
                        batch.logits[i] = i == n - 1
                    assert L.llama_decode(ctx, batch) == 0
                L.llama_batch_free(batch)
                mem = L.llama_get_memory(ctx)
                assert window.whole(ctx, 0, 400, streams)
                L.llama_memory_seq_rm(mem, 0, 390, -1)
                assert window.whole(ctx, 0, 390, streams)
                L.llama_memory_seq_rm(mem, 0, 100, -1)
                assert not window.whole(ctx, 0, 100, streams)
            finally:
                L.llama_free(ctx)
    finally:
        L.llama_model_free(model)


def test_drafts_on_a_window_cache_change_nothing(engines: dict[str, Engine]) -> None:
    # sentences the grammar allows, which the n-gram index drafts from and the model
    # follows only in part
    prompt = engines["window"].tokenize(PROMPT + ". The red fox jumps over the lazy dog. "
                                        "The old cat jumps over the lazy dog. The big dog "
                                        "jumps over the lazy dog.", add_special=True)
    on = fresh(engines["window"], prompt, num_predict=96, grammar=GRAMMAR)
    off = fresh(engines["plain"], prompt, num_predict=96, grammar=GRAMMAR)
    same_output(on, off)
    assert on[1].stats.draft_accepted_count > 0
    assert on[1].stats.draft_count > on[1].stats.draft_accepted_count  # some taken back


def test_a_chat_back_from_ram_and_from_disk_goes_back_to_its_checkpoint(
        window_gguf: Path, tmp_path: Path, engines: dict[str, Engine]) -> None:
    """A chat goes to the RAM cache with its slot's checkpoints when another takes the
    slot: a prompt that keeps all but the end of what it held comes back to the
    checkpoint one token before the first prompt's end. That chat goes to the disk tier
    at the stop, and the same prompt after a new load reads only its last token."""
    cfg = config(cache_ram=64 << 20, cache_disk=64 << 20, cache_dir=str(tmp_path))
    first = Engine(str(window_gguf), cfg)
    first.start()
    try:
        prompt = first.tokenize(PROMPT, add_special=True)
        tokens = list(run(first, prompt, num_predict=16)[1].stats.context)
        again = tokens[:-3] + [tokens[-1]]
        run(first, first.tokenize("Zebras graze on the plain.", add_special=False),
            num_predict=4)  # the other chat takes the slot: the first goes to RAM
        from_ram = run(first, again, num_predict=12)
    finally:
        first.stop()
    second = Engine(str(window_gguf), cfg)
    second.start()
    try:
        from_disk = run(second, again, num_predict=12)
    finally:
        second.stop()
    want = fresh(engines["full"], again, num_predict=12)
    assert from_ram[1].stats.prompt_eval_count == len(again) - (len(prompt) - 1)
    # what went to disk at the stop was that prompt's slot, with its own checkpoint
    # one token before its end
    assert from_disk[1].stats.prompt_eval_count == 1
    for out in (from_ram, from_disk):
        same_output(out, want)


def test_a_burst_branches_from_the_prefix_its_first_request_computes(
        window_gguf: Path, engines: dict[str, Engine]) -> None:
    """Two requests share a prefix far past the window. The first's prefill stops a few
    tokens before the prefix ends (BRANCH_MARGIN), so that the second branches from its
    state whole (it could not be cut back there once the first had read on). Two more
    that part two tokens sooner then keep most of the prefix in both slots: the branched
    one too, from where it branched (prefix.py's second burst read its prompts whole
    without the margin: a 512-token window's slot is cut back within it)."""
    from corral.runner.engine.placer import BRANCH_MARGIN
    from corral.runner.engine.schedule import MARK_SPACING

    engine = Engine(str(window_gguf), config(n_slots=2, n_batch=512))
    shared = engine.tokenize(PROMPT + " " + PROMPT, add_special=True)
    prompts = [shared + engine.tokenize(tail, add_special=False)
               for tail in (" to drink.", " and then it swam across to the other side.")]
    jobs = [Job(prompt=p, params=SamplingParams(temperature=0), num_predict=8,
                ignore_eos=True) for p in prompts]
    for job in jobs:  # both queued before the first step
        engine.submit(job)
    engine.start()
    try:
        done = [collect(job) for job in jobs]
        sooner = [shared[:-2] + engine.tokenize(tail, add_special=False)
                  for tail in (" to eat.", " and went home.")]
        again = [Job(prompt=p, params=SamplingParams(temperature=0), num_predict=8,
                     ignore_eos=True) for p in sooner]
        for job in again:
            engine.submit(job)
        done += [collect(job) for job in again]
    finally:
        engine.stop()
    n = len(shared)
    assert done[0][1].stats.prompt_eval_count == len(prompts[0])
    assert done[1][1].stats.prompt_eval_count == len(prompts[1]) - (n - BRANCH_MARGIN)
    # the first slot cut back in its window; the branched one (its window past what
    # this one keeps) back to its checkpoint where it branched: the margin's
    assert done[2][1].stats.prompt_eval_count == len(sooner[0]) - (n - 2)
    assert done[3][1].stats.prompt_eval_count == len(sooner[1]) - (n - BRANCH_MARGIN)
    # one checkpoint where each was placed, none again a few tokens later at its end
    # (a window's slot is cut back that far without one: schedule.MARK_SPACING)
    near = min(MARK_SPACING, WINDOW // 4)
    for slot in engine.slots:
        marks = sorted(m for m, _ in slot.checkpoints)
        assert all(b - a >= near for a, b in zip(marks, marks[1:])), marks
    for (_, d), p in zip(done, prompts + sooner):
        assert list(d.stats.context) == list(fresh(engines["full"], p, num_predict=8)[1]
                                             .stats.context)


def test_the_greedy_answer_is_llama_cpps_alone_batched_and_after_a_checkpoint(
        window_gguf: Path, engines: dict[str, Engine]) -> None:
    texts = (PROMPT, "Mountains rise above the valley, and rivers run below them to the "
             "sea, where the ships wait for the wind", "Once upon a time")
    prompts = [engines["window"].tokenize(t, add_special=True) for t in texts]
    want = [llama_cpp_greedy(window_gguf, p, 40) for p in prompts]
    for name in ("window", "plain"):
        assert [list(fresh(engines[name], p, num_predict=40)[1].stats.context[len(p):])
                for p in prompts] == want
        again = run(engines[name], prompts[-1], num_predict=40)
        assert list(again[1].stats.context[len(prompts[-1]):]) == want[-1]
    three = Engine(str(window_gguf), config(n_slots=3))
    three.start()
    try:
        done = [collect(three.submit(Job(prompt=p, params=SamplingParams(temperature=0),
                                         num_predict=40, ignore_eos=True)))
                for p in prompts]
    finally:
        three.stop()
    assert [list(d.stats.context[len(p):]) for (_, d), p in zip(done, prompts)] == want


def test_a_recent_cut_is_tried_only_where_the_copied_window_reaches() -> None:
    """A state copied into a slot (llama.cpp writes only the cells its end's window
    sees) is cut back without a checkpoint only where what came after it holds the
    window before the cut (Slot.window_from)."""
    cuts = Cuts(WINDOW, CHECKPOINTS)
    assert cuts.recent(100, 90) and cuts.recent(100, 90, since=90 - WINDOW)
    assert not cuts.recent(100, 90, since=100 - WINDOW)  # a settled slot: its end's window
    assert not cuts.recent(100, 100 - WINDOW)  # the ring may have come round
    assert cuts.recent(10, 5, since=0)  # the window before 5 starts at 0
    assert not Cuts().recent(100, 90) and not Cuts(0, CHECKPOINTS).recent(100, 99)
