"""A hybrid model (recurrent layers beside attention) on the engine, a tiny random LFM2
the tests write (tests/hybrid_model.py). Its memory cannot be cut back to an earlier
position, but llama.cpp keeps the states of a sequence's last tokens (n_rs_seq), so a
rejected draft is taken back and speculation stays on: the output is plain decoding's,
logprobs and all, with batch-invariant kernels. A cut the memory cannot make (a prompt
that keeps less of a slot than it holds) is never asked of llama.cpp, whose snapshots
would take back a few positions from states no draft wrote: the slot goes back to a
checkpoint, its recurrent state read where a later prompt is likely to branch (one
token before a prompt's end, and where a turn starts past what the slot kept)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest

from corral.runner.engine.engine import Engine
from corral.runner.jobs import Done, Job, SamplingParams, Token
from corral.runner.layerkinds import RS_SEQ, snapshot_planes
from corral.runner.llama.context import CHECKPOINTS, EngineConfig
from corral.runner.prefix import Cuts
from tests.support import (FlatCost, greedy, llama_cpp_greedy, same_output, started,
                           wait_for)

# The model's own choices (an adjective, an animal) follow from its state: after a
# rollback that left the state wrong, the choices and their logprobs would change.
GRAMMAR = ('root ::= ("The " ("red" | "blue" | "green" | "old" | "big") " " '
           '("fox" | "cat" | "dog") " jumps over the lazy dog. ")+')
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def hybrid_gguf(chat_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.hybrid_model import write_hybrid

    return write_hybrid(chat_gguf, tmp_path_factory.mktemp("hybrid") / "lfm2.gguf")


@pytest.fixture(scope="module")
def engines(hybrid_gguf: Path) -> Iterator[dict[bool, Engine]]:
    made = {spec: Engine(str(hybrid_gguf), EngineConfig(
        n_slots=1, num_ctx=1024, deterministic=True, speculative=spec), cost=FlatCost())
        for spec in (True, False)}
    yield from started(made)


run = greedy


same = same_output


def test_a_hybrid_memory_keeps_states_for_drafts_only_with_speculation_on(
        engines: dict[bool, Engine]) -> None:
    on, off = engines[True].llama, engines[False].llama
    assert on.recurrent and on.cuts == Cuts(0, CHECKPOINTS) and on.state_bytes > 0
    assert on.undo == RS_SEQ and on.can_rollback and engines[True].spec is not None
    # the slot and a scratch sequence keep RS_SEQ states each; the slot its checkpoints
    assert on.checkpoints == off.checkpoints == CHECKPOINTS
    assert on.snapshot_bytes() == on.state_bytes * RS_SEQ * 2
    assert on.checkpoint_bytes() == off.checkpoint_bytes() == on.state_bytes * CHECKPOINTS
    assert off.undo == 0 and not off.can_rollback and engines[False].spec is None
    assert off.snapshot_bytes() == 0


def test_snapshots_take_at_most_a_tenth_of_the_weights() -> None:
    assert snapshot_planes(2_000, 2, 3_000_000) == RS_SEQ
    assert snapshot_planes(1 << 20, 17, 1 << 30) == 6  # 16 slots of a 1 MB state, 1 GB
    assert snapshot_planes(50 << 20, 17, 6 << 30) == 0  # speculation off: none fits
    assert snapshot_planes(50 << 20, 4, 6 << 30, CHECKPOINTS) == 3


def test_drafts_on_a_hybrid_change_nothing(engines: dict[bool, Engine]) -> None:
    prompt = engines[True].tokenize(PROMPT, add_special=True)
    on = run(engines[True], prompt, num_predict=96, grammar=GRAMMAR)
    off = run(engines[False], prompt, num_predict=96, grammar=GRAMMAR)
    same(on, off)
    stats = on[1].stats
    # drafts were kept, and some were taken back: the rollback ran
    assert stats.draft_accepted_count > 0
    assert stats.draft_count > stats.draft_accepted_count
    assert off[1].stats.draft_count == 0


def fresh(engine: Engine, tokens: list[int], **job: Any) -> tuple[list[Token], Done]:
    """`tokens` read whole: another prompt takes the slot first (nothing in common)."""
    other = engine.tokenize("Zebras", add_special=False)
    assert other[0] != tokens[0]
    run(engine, other, num_predict=1)
    out = run(engine, tokens, **job)
    assert out[1].stats.prompt_eval_count == len(tokens)
    return out


@pytest.mark.parametrize("spec", [True, False], ids=["drafting", "plain"])
def test_a_regenerate_reads_only_the_last_prompt_token(engines: dict[bool, Engine],
                                                       spec: bool) -> None:
    engine = engines[spec]
    prompt = engine.tokenize(PROMPT, add_special=True)
    first = fresh(engine, prompt, num_predict=16)
    again = run(engine, prompt, num_predict=16)  # back to the state one token short
    assert again[1].stats.prompt_eval_count == 1
    same(again, first)


def test_a_tail_is_read_in_one_step_and_its_state_one_token_short_after_it(
        hybrid_gguf: Path) -> None:
    """With llama.cpp's snapshots (speculation on) the memory takes a prompt's last token
    back after the step that read it, and the state one token short is read there: a
    tail goes in one step, a regenerate then reads only that token, and so does the next
    one, from that checkpoint; a sequence that goes on reads the token again before its
    next, and one that ended decodes it again at rest. The output is plain decoding's.
    Without snapshots (speculation off) the prefill stops a token short: two steps, its
    last token alone in the second."""
    outs = {}
    for spec in (True, False):
        rows: list[int] = []  # each step's, counted as it is planned
        engine = Engine(str(hybrid_gguf), EngineConfig(
            n_slots=1, num_ctx=1024, deterministic=True, speculative=spec), cost=FlatCost(),
            step_hook=lambda plan: rows.append(len(plan.batch.rows)))
        engine.start()
        try:
            turn = engine.tokenize(PROMPT, add_special=True)
            tail = engine.tokenize(" The fox ran into the woods.", add_special=False)
            run(engine, turn, num_predict=1)  # the slot keeps it all (a token owed at rest)
            prompt = turn + tail
            rows.clear()
            run(engine, prompt, num_predict=1)
            assert rows == ([len(tail)] if spec else [len(tail) - 1, 1])
            first = run(engine, prompt, num_predict=12)
            again = run(engine, prompt, num_predict=12)  # the slot holds 11 more: back
            assert first[1].stats.prompt_eval_count == again[1].stats.prompt_eval_count == 1
            same(again, first)
            outs[spec] = again
        finally:
            engine.stop()
    same(outs[True], outs[False])


CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


def test_a_long_chat_prompt_stops_where_its_last_message_ends(
        engines: dict[bool, Engine]) -> None:
    """A chat prompt read in more than a batch stops where its last message ends (the
    first control token of the template's end of turn: ChatML's <|im_end|>), and its
    state is read there: an edit that adds to the last message reads only from there,
    not from a batch before the end; a regenerate still reads one token. The answers
    are plain decoding's."""
    engine = engines[True]
    end_of_turn = engine.tokenize("<|im_end|>", add_special=False)
    assert len(end_of_turn) == 1 and engine.llama.is_control(end_of_turn[0])
    content = " ".join([LONG] * 5)
    prompt = engine.tokenize(CHAT.format(content), add_special=True)
    assert len(prompt) > engine.llama.n_batch
    ends = prompt.index(end_of_turn[0])
    first = fresh(engine, prompt, num_predict=8)
    again = run(engine, prompt, num_predict=8)
    assert again[1].stats.prompt_eval_count == 1
    same(again, first)
    edited = engine.tokenize(CHAT.format(content + " And one more."), add_special=True)
    assert edited[:ends] == prompt[:ends] and edited[ends] != prompt[ends]
    out = run(engine, edited, num_predict=8)
    assert out[1].stats.prompt_eval_count == len(edited) - ends
    same(out, fresh(engine, edited, num_predict=8))


def test_an_edited_last_message_goes_back_to_the_turn_before(
        engines: dict[bool, Engine]) -> None:
    engine = engines[True]
    tokenize = engine.tokenize
    turn1 = tokenize(PROMPT, add_special=True)
    reply = list(run(engine, turn1, num_predict=12)[1].stats.context)[len(turn1):]
    history = turn1 + reply
    asked = run(engine, history + tokenize(" Tell me more about the fox.", add_special=False),
                num_predict=12)
    assert asked[1].stats.prompt_eval_count < asked[1].stats.prompt_tokens  # the turn kept
    edited = history + tokenize(" Tell me about the dog instead.", add_special=False)
    out = run(engine, edited, num_predict=12)
    # read from where the second turn started, not from scratch
    assert out[1].stats.prompt_eval_count <= len(edited) - len(history) + 1
    same(out, fresh(engine, edited, num_predict=12))


def test_a_prompt_that_keeps_part_of_the_slot_goes_back_to_a_checkpoint(
        engines: dict[bool, Engine]) -> None:
    """The slot holds a prompt and 16 generated tokens (the last decoded alone); the next
    prompt keeps all but the last three. llama.cpp would take those three back from the
    snapshots of a one-token ubatch; the engine goes back to the checkpoint one token
    before the first prompt's end instead, and reads the rest."""
    for spec in (True, False):
        engine = engines[spec]
        prompt = engine.tokenize(PROMPT, add_special=True)
        tokens = list(run(engine, prompt, num_predict=16)[1].stats.context)
        assert tokens[:len(prompt)] == prompt and len(tokens) == len(prompt) + 16
        again = tokens[:-3] + [tokens[-1]]  # all but the last three, and one of its own
        out = run(engine, again, num_predict=24)
        assert out[1].stats.prompt_eval_count == len(again) - (len(prompt) - 1)
        same(out, fresh(engine, again, num_predict=24))


LONG = " ".join(["The quick brown fox jumps over the lazy dog near the river bank."] * 8)


@pytest.fixture(scope="module")
def cached(hybrid_gguf: Path) -> Iterator[Engine]:
    made = Engine(str(hybrid_gguf), EngineConfig(n_slots=1, num_ctx=1024, deterministic=True,
                                                 cache_ram=64 << 20))
    made.start()
    yield made
    made.stop()


def test_a_chat_back_from_the_ram_cache_goes_back_to_its_checkpoint(
        cached: Engine, engines: dict[bool, Engine]) -> None:
    """Two chats alternate on one slot: the first goes to the RAM cache with its slot's
    checkpoints when the second takes the slot, and a prompt that keeps all but the end
    of what it held comes back to the checkpoint one token before its prompt's end."""
    prompt = cached.tokenize(LONG, add_special=True)
    tokens = list(run(cached, prompt, num_predict=16)[1].stats.context)
    run(cached, cached.tokenize("Zebras graze on the open plain.", add_special=False),
        num_predict=4)  # the other chat takes the slot: the first goes to RAM
    again = tokens[:-3] + [tokens[-1]]
    out = run(cached, again, num_predict=12)
    assert out[1].stats.prompt_eval_count == len(again) - (len(prompt) - 1)
    same(out, fresh(engines[True], again, num_predict=12))  # no RAM cache there


def test_a_chat_that_ended_in_its_prompts_step_goes_to_ram_whole(
        cached: Engine, engines: dict[bool, Engine]) -> None:
    """A request for one token ends in the step that read its prompt, whose last token
    the memory took back for the checkpoint one token short: the slot owes the token and
    decodes it again at rest, so it holds the whole prompt. A regenerate still reads one
    token, from the checkpoint; the next conversation saves all of the prompt to RAM, and
    the chat back reads only what it adds."""
    prompt = cached.tokenize(LONG + " Once more.", add_special=True)
    slot = cached.slots[0]
    run(cached, prompt, num_predict=1)
    wait_for(lambda: slot.cached == prompt and slot.owed is None, timeout=120)
    assert [n for n, _ in slot.checkpoints][-1] == len(prompt) - 1
    again = run(cached, prompt, num_predict=1)
    assert again[1].stats.prompt_eval_count == 1
    wait_for(lambda: slot.cached == prompt, timeout=120)
    run(cached, cached.tokenize("Zebras graze on the open plain.", add_special=False),
        num_predict=4)  # the other chat takes the slot: the first goes to RAM
    tail = cached.tokenize(" And the dog slept.", add_special=False)
    back = run(cached, prompt + tail, num_predict=12)
    assert back[1].stats.prompt_eval_count == len(tail)
    same(back, fresh(engines[True], prompt + tail, num_predict=12))
    same(again, fresh(engines[True], prompt, num_predict=1))


def test_a_chat_resumed_after_an_unload_goes_back_to_its_checkpoint_on_disk(
        hybrid_gguf: Path, tmp_path: Path, engines: dict[bool, Engine]) -> None:
    """The slot's state and its checkpoints go to the disk tier at the stop; the next
    load reads them back and goes back to the checkpoint one token before the first
    prompt's end."""
    config = EngineConfig(n_slots=1, num_ctx=1024, deterministic=True, cache_ram=64 << 20,
                          cache_disk=256 << 20, cache_dir=str(tmp_path))
    first = Engine(str(hybrid_gguf), config)
    first.start()
    try:
        prompt = first.tokenize(LONG, add_special=True)
        tokens = list(run(first, prompt, num_predict=16)[1].stats.context)
    finally:
        first.stop()
    second = Engine(str(hybrid_gguf), config)
    second.start()
    try:
        assert [e.marks for e in second.caches.disk.entries] == [(len(prompt) - 1,)]
        again = tokens[:-3] + [tokens[-1]]
        out = run(second, again, num_predict=12)
    finally:
        second.stop()
    assert out[1].stats.prompt_eval_count == len(again) - (len(prompt) - 1)
    same(out, fresh(engines[True], again, num_predict=12))


def test_the_greedy_answer_is_llama_cpps_alone_batched_and_after_a_checkpoint(
        hybrid_gguf: Path, engines: dict[bool, Engine]) -> None:
    engine = engines[True]
    prompts = [engine.tokenize(text, add_special=True) for text in
               (LONG, "Once upon a time there was a fox", "Mountains rise above the valley.")]
    want = [llama_cpp_greedy(hybrid_gguf, p, 20) for p in prompts]
    for spec in (True, False):
        assert [list(fresh(engines[spec], p, num_predict=20)[1].stats.context[len(p):])
                for p in prompts] == want
        again = run(engines[spec], prompts[-1], num_predict=20)  # from its checkpoint
        assert again[1].stats.prompt_eval_count == 1
        assert list(again[1].stats.context[len(prompts[-1]):]) == want[-1]
    two = Engine(str(hybrid_gguf), EngineConfig(n_slots=3, num_ctx=1024))
    two.start()
    try:
        jobs = [two.submit(Job(prompt=p, params=SamplingParams(temperature=0),
                               num_predict=20, ignore_eos=True)) for p in prompts]
        done = []
        for job in jobs:  # all three decode in one batch
            while isinstance(event := job.events.get(timeout=300), Token):
                pass
            assert isinstance(event, Done), event
            done.append(list(event.stats.context))
    finally:
        two.stop()
    assert [d[len(p):] for d, p in zip(done, prompts)] == want


def test_a_restored_slot_keeps_the_entrys_checkpoints_not_its_own(
        cached: Engine, engines: dict[bool, Engine]) -> None:
    """A slot that held a short chat gets a long one back from the RAM cache: the short
    chat's checkpoints are not the long one's, so a prompt sharing less of the long chat
    than its own checkpoint reads everything again, rather than going back to a state of
    the other chat."""
    long = cached.tokenize(LONG, add_special=True)
    short = cached.tokenize("Mountains rise above the valley, and rivers run below.",
                            add_special=True)
    assert len(short) < 40 < len(long) - 1
    tokens = list(run(cached, long, num_predict=16)[1].stats.context)
    run(cached, short, num_predict=16)  # a checkpoint one token before its prompt's end
    back = run(cached, tokens[:-3] + [tokens[-1]], num_predict=4)  # from RAM
    assert back[1].stats.prompt_eval_count < len(tokens) - len(long)
    shorter = tokens[:40] + cached.tokenize(" and then", add_special=False)
    out = run(cached, shorter, num_predict=12)
    assert out[1].stats.prompt_eval_count == len(shorter)
    same(out, fresh(engines[True], shorter, num_predict=12))
