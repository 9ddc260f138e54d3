"""The prompt cache's policies, without llama.cpp: which entry a prompt restores, what is
evicted, what the disk tier refuses, which keys never match, and when the placer
branches from a running slot or holds a sequence for a prefix about to be computed."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from corral.runner.cache.caches import PrefixCaches, caches_for
from corral.runner.cache.diskcache import DiskTier
from corral.runner.llama.context import EngineConfig
from corral.runner.jobs import Job
from corral.runner.cache.promptcache import MIN_TOKENS, PromptCache
from corral.runner.engine.placer import HOLD_MIN, MIN_GAIN, Placement, Placer, Source
from corral.runner.slots.sequence import Sequence
from corral.runner.prefix import common_prefix
from corral.runner.slots.slot import Slot, SlotState
from tests.gguf_files import write_tiny_gguf

A = list(range(100, 300))  # 200 tokens
B = list(range(500, 700))


def test_the_longest_common_prefix_wins() -> None:
    cache = PromptCache(budget=10_000)
    cache.add(A[:100], b"x" * 10)
    cache.add(B, b"y" * 10)
    entry, n = cache.lookup(A[:150] + [1, 2, 3])
    assert entry is not None and entry.tokens == tuple(A[:100]) and n == 100
    entry, n = cache.lookup(B[:120] + A)
    assert entry is not None and entry.tokens == tuple(B) and n == 120
    assert cache.lookup(A[:MIN_TOKENS - 1] + B) == (None, 0)  # too short to be worth a copy


def test_eviction_is_least_recently_used_within_the_byte_budget() -> None:
    cache = PromptCache(budget=30)
    prompts = [[k] * 40 for k in range(4)]
    for p in prompts[:3]:
        assert cache.add(p, b"z" * 10)
    entry, _ = cache.lookup(prompts[0])
    assert entry is not None
    cache.restored(entry, 40)  # the oldest is used again, so the second is now the oldest
    assert cache.add(prompts[3], b"z" * 10)
    held = [e.tokens[0] for e in cache.entries]
    assert sorted(held) == [0, 2, 3] and cache.size == 30 and cache.stats.evicted == 1
    assert not cache.add([9] * 40, b"z" * 31)  # bigger than the whole budget: never kept
    assert cache.describe()["cache_hits"] == 1 and cache.describe()["cache_bytes"] == 30


def test_an_entry_extended_by_a_longer_one_goes_and_a_covered_one_is_not_saved() -> None:
    cache = PromptCache(budget=1000)
    cache.add(A[:80], b"a")
    cache.add(A, b"b")  # the same conversation a turn later
    assert [len(e.tokens) for e in cache.entries] == [200]
    assert not cache.worth_saving(A[:150]) and not cache.add(A[:150], b"c")
    assert PromptCache(budget=0).worth_saving(A) is False  # off


def test_an_entry_a_few_tokens_off_a_newer_one_goes_with_it() -> None:
    """Sixteen requests after one document differ in a short question: one copy is kept,
    the newest; one that holds min_tokens more of its own stays."""
    cache = PromptCache(budget=1000)
    assert cache.add(A + [1] * 10, b"a")
    assert cache.add(A + [2] * (MIN_TOKENS - 1), b"b")  # a's 10 tokens of its own: a goes
    assert [e.data for e in cache.entries] == [b"b"]
    assert cache.add(A + [3] * MIN_TOKENS, b"c")  # b holds MIN_TOKENS - 1 of its own: b goes
    assert cache.add(B, b"d") and cache.add(A[:150] + [5] * MIN_TOKENS, b"e")
    assert sorted(e.data for e in cache.entries) == [b"c", b"d", b"e"]  # c keeps 50 + 32


def test_common_prefix_matches_a_walk_over_lists_and_tuples() -> None:
    rng = random.Random(7)
    for _ in range(500):
        a = [rng.randint(0, 2) for _ in range(rng.randint(0, 300))]
        cut = rng.randint(0, len(a))
        b = a[:cut] + [rng.randint(0, 2) for _ in range(rng.randint(0, 200))]
        walk = 0
        while walk < min(len(a), len(b)) and a[walk] == b[walk]:
            walk += 1
        assert common_prefix(a, b) == common_prefix(tuple(a), b) == walk
        assert common_prefix(b, tuple(a)) == walk


def test_spilled_entries_go_to_the_disk_tier(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 1 << 20, "space")
    caches = PrefixCaches(PromptCache(budget=15), disk)
    caches.save(A, b"a" * 10)
    caches.save(B, b"b" * 10)  # evicts A from RAM, to disk
    hit = caches.lookup(A + [1])
    assert hit.entry is None and hit.disk is not None and hit.n == len(A)
    assert disk.load(hit.disk) == b"a" * 10
    assert caches.lookup(A + [1], disk=False).disk is None  # RAM alone: the engine's own look


def test_the_disk_tier_survives_a_restart_and_refuses_corrupt_entries(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 1 << 20, "space")
    assert disk.save(A, b"state-a" * 100) and disk.save(B, b"state-b" * 100)
    again = DiskTier(tmp_path, 1 << 20, "space")  # a restarted runner indexes what is there
    found, n = again.lookup(A + [7])
    assert found is not None and n == len(A) and again.load(found) == b"state-a" * 100
    # A flipped byte in the data: the hash no longer matches, so it is removed, not loaded.
    found, _ = again.lookup(B)
    assert found is not None
    raw = bytearray(found.path.read_bytes())
    raw[-1] ^= 0xFF
    found.path.write_bytes(bytes(raw))
    assert again.load(found) is None and not found.path.exists()
    assert again.lookup(B) == (None, 0) and again.rejected == 1
    # A truncated file and a header from elsewhere are removed when indexed.
    found, _ = again.lookup(A)
    assert found is not None
    found.path.write_bytes(found.path.read_bytes()[:20])
    (tmp_path / "space" / "junk.kv").write_bytes(b"not a cache file at all")
    third = DiskTier(tmp_path, 1 << 20, "space")
    assert third.entries == [] and third.rejected == 2
    assert list((tmp_path / "space").iterdir()) == []


def test_a_recurrent_memorys_checkpoints_go_to_disk_after_its_state(tmp_path: Path) -> None:
    """Each checkpoint follows the state, its length in the header, the hash over all;
    a file whose checkpoints do not add up is removed, never loaded."""
    disk = DiskTier(tmp_path, 1 << 20, "space")
    checkpoints = ((40, b"c" * 30), (60, b"d" * 20))
    assert disk.save(A, b"state-a" * 100, checkpoints)
    assert disk.entries[0].marks == (40, 60)
    again = DiskTier(tmp_path, 1 << 20, "space")
    found, _ = again.lookup(A)
    assert found is not None and found.marks == (40, 60)
    read = again.read(found)
    assert read.data == b"state-a" * 100 and read.checkpoints == checkpoints
    raw = found.path.read_bytes()
    found.path.write_bytes(raw.replace(b"[60, 20]", b"[60, 900]"))  # longer than the data
    assert again.load(found) is None and not found.path.exists()


def test_an_entry_of_another_namespace_is_never_loaded(tmp_path: Path) -> None:
    DiskTier(tmp_path, 1 << 20, "one").save(A, b"a" * 50)
    (tmp_path / "one" / next((tmp_path / "one").iterdir()).name).rename(
        tmp_path / "two.kv")
    (tmp_path / "two").mkdir()
    (tmp_path / "two.kv").rename(tmp_path / "two" / "moved.kv")
    other = DiskTier(tmp_path, 1 << 20, "two")  # the header still names "one"
    assert other.entries == [] and other.rejected == 1


def test_the_disk_budget_holds_every_model_together(tmp_path: Path) -> None:
    first = DiskTier(tmp_path, 4000, "first")
    first.save(A, b"a" * 1500)  # with its header, about 2.5 kB on disk
    second = DiskTier(tmp_path, 4000, "second")
    second.save(B, b"b" * 1500)  # together over the budget: the other model's oldest goes
    files = sorted(p.parent.name for p in tmp_path.glob("*/*.kv"))
    assert files == ["second"]


def keys(tmp_path: Path, **changes: object) -> str:
    model = tmp_path / "model.gguf"
    if not model.exists():
        write_tiny_gguf(model)
    cfg = EngineConfig(cache_ram=1, cache_disk=1 << 20, cache_dir=str(tmp_path / "kv"),
                       **changes)  # type: ignore[arg-type]
    caches = caches_for(str(model), cfg)
    assert caches.disk is not None
    return caches.disk.space


def test_keys_that_must_not_match(tmp_path: Path) -> None:
    base = keys(tmp_path)
    assert keys(tmp_path) == base  # stable: a restart finds its entries
    adapter = tmp_path / "lora.gguf"
    write_tiny_gguf(adapter)
    assert keys(tmp_path, kv_cache_type="q8_0") != base
    assert keys(tmp_path, adapters=((str(adapter), 1.0),)) != base
    assert keys(tmp_path, adapters=((str(adapter), 0.5),)) != keys(
        tmp_path, adapters=((str(adapter), 1.0),))
    assert keys(tmp_path, flash_attn=True) != base
    other = tmp_path / "other.gguf"
    write_tiny_gguf(other)
    os.utime(other, ns=(1, 1))
    cfg = EngineConfig(cache_ram=1, cache_disk=1 << 20, cache_dir=str(tmp_path / "kv"))
    other_caches = caches_for(str(other), cfg)
    assert other_caches.disk is not None and other_caches.disk.space != base


def test_images_are_part_of_the_key() -> None:
    # An image is a run of one placeholder id derived from its hash (runner.llama.vision):
    # another image stops the match where it starts.
    cache = PromptCache(budget=1000)
    text = list(range(1, 60))
    cache.add(text + [-11] * 40 + [5, 6], b"s")
    _, n = cache.lookup(text + [-22] * 40 + [5, 6])
    assert n == len(text)  # the text before it, never the other image's KV
    _, n = cache.lookup(text + [-11] * 40 + [9])
    assert n == len(text) + 40


def busy(seq_id: int, cached: list[int], pending: list[int]) -> Slot:
    slot = Slot(seq_id=seq_id, num_ctx=4096)
    seq = Sequence(Job(prompt=cached + pending))
    slot.assign(seq, cached)
    seq.start(10, cached + pending, len(cached), now=1.0)
    return slot


def waiting(prompt: list[int]) -> Sequence:
    return Sequence(Job(prompt=prompt))


def test_a_sequence_waits_for_a_shared_prefix_being_prefilled_then_branches() -> None:
    shared = list(range(1000, 1000 + 2 * HOLD_MIN))
    leader = busy(0, shared[:10], shared[10:] + [1, 2, 3])
    idle = Slot(seq_id=1, num_ctx=4096)
    placer = Placer(4096, PrefixCaches(PromptCache(budget=0)))
    follower = waiting(shared + [7, 8, 9])
    placer.add(follower)
    assert placer.next([leader, idle]) is None  # held: the leader is computing its prefix
    leader.cached = shared + [1]  # the leader's prefill covered the shared part
    leader.sequence.pending = [2, 3]  # type: ignore[union-attr]
    p = placer.next([leader, idle])
    assert isinstance(p, Placement) and p.source is Source.BRANCH
    assert p.donor is leader and p.slot is idle and p.n_prefix == len(shared)
    assert not placer.waiting


def test_an_unrelated_sequence_is_not_held_behind_one_that_is() -> None:
    shared = list(range(1000, 1000 + 2 * HOLD_MIN))
    leader = busy(0, [], shared)
    placer = Placer(4096, PrefixCaches(PromptCache(budget=0)))
    placer.add(waiting(shared + [1]))
    placer.add(waiting([5] * 50))
    p = placer.next([leader, Slot(seq_id=1, num_ctx=4096)])
    assert isinstance(p, Placement) and p.seq.job.prompt == [5] * 50


def test_restore_beats_reuse_only_by_a_real_gain() -> None:
    ram = PromptCache(budget=1 << 20)
    ram.add(A, b"a")
    placer = Placer(4096, PrefixCaches(ram))
    slot = Slot(seq_id=0, num_ctx=4096, cached=A[:200 - MIN_GAIN + 1])
    placer.add(waiting(A + [1]))
    p = placer.next([slot])
    assert isinstance(p, Placement) and p.source is Source.REUSE  # the gain is too small
    slot = Slot(seq_id=0, num_ctx=4096, cached=B)
    placer.add(waiting(A + [1]))
    p = placer.next([slot])
    assert isinstance(p, Placement) and p.source is Source.RESTORE and p.n_prefix == len(A)
    assert p.entry is not None and p.slot is slot


def test_a_prefix_never_ends_inside_the_prompt() -> None:
    ram = PromptCache(budget=1 << 20)
    ram.add(A, b"a")
    placer = Placer(4096, PrefixCaches(ram))
    placer.add(waiting(list(A)))  # the whole prompt is cached: one token is decoded again
    p = placer.next([Slot(seq_id=0, num_ctx=4096)])
    assert isinstance(p, Placement) and p.n_prefix == len(A) - 1


@pytest.mark.parametrize("state", [SlotState.PREFILL, SlotState.DECODE])
def test_a_tainted_slot_is_never_a_donor(state: SlotState) -> None:
    donor = busy(0, A, [] if state is SlotState.DECODE else [1])
    donor.tainted = True  # a context shift ran: its KV is not what a prefill would give
    placer = Placer(4096, PrefixCaches(PromptCache(budget=0)))
    placer.add(waiting(A + [2]))
    p = placer.next([donor, Slot(seq_id=1, num_ctx=4096)])
    assert isinstance(p, Placement) and p.source is Source.NONE
