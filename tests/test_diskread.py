"""Reads of the disk tier off the engine thread (runner.cache.diskread), without llama.cpp: a
held read holds only its own sequence, a corrupt or swapped entry gives no bytes, a read
past its deadline gives up and stops further reads until it returns, a cancelled
sequence leaves, and sequences that want one entry share one read."""

from __future__ import annotations

import threading
from pathlib import Path

from corral.runner.cache.caches import PrefixCaches
from corral.runner.cache.diskcache import DiskEntry, DiskTier, Read
from corral.runner.cache.diskread import DiskReads
from corral.runner.jobs import Job
from corral.runner.cache.promptcache import PromptCache
from corral.runner.engine.placer import Placement, Placer, Source
from corral.runner.slots.sequence import Sequence
from corral.runner.slots.slot import Slot

A = list(range(100, 300))
B = list(range(500, 700))
WAIT = 30.0  # seconds a test waits for a helper thread before it fails


class Gate:
    """A reader the test holds: each read waits for `release`, counting its calls."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.calls = 0
        self.threads: list[str] = []

    def __call__(self, tier: DiskTier, entry: DiskEntry) -> Read:
        self.calls += 1
        self.threads.append(threading.current_thread().name)
        self.started.set()
        assert self.release.wait(WAIT)
        return tier.read(entry)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def tier_with(tmp_path: Path, *prompts: list[int]) -> DiskTier:
    tier = DiskTier(tmp_path, 1 << 20, "space")
    for i, tokens in enumerate(prompts):
        assert tier.save(tokens, bytes([65 + i]) * 1000)
    return tier


def entry_of(tier: DiskTier, tokens: list[int]) -> DiskEntry:
    found, _ = tier.lookup(tokens)
    assert found is not None
    return found


def reads_for(tier: DiskTier, gate: Gate, **kw: object) -> tuple[DiskReads, threading.Event]:
    wake = threading.Event()
    return DiskReads(tier, wake.set, gate, **kw), wake  # type: ignore[arg-type]


def test_a_swapped_entry_is_refused_and_removed(tmp_path: Path) -> None:
    tier = tier_with(tmp_path, A, B)
    a, b = entry_of(tier, A), entry_of(tier, B)
    raw_a, raw_b = a.path.read_bytes(), b.path.read_bytes()
    a.path.write_bytes(raw_b)  # whole and hashed right, but another prefix's state
    b.path.write_bytes(raw_a)
    read = tier.read(a)
    assert read.data is None and "not this entry" in read.problem
    assert tier.settle(a, read) is None and not a.path.exists() and tier.rejected == 1
    assert tier.lookup(A) == (None, 0)


def test_a_held_read_holds_only_its_own_sequence(tmp_path: Path) -> None:
    tier = tier_with(tmp_path, A)
    gate = Gate()
    reads, wake = reads_for(tier, gate)
    seq = Sequence(Job(prompt=A + [1]))
    reads.start(seq, entry_of(tier, A))
    assert gate.started.wait(WAIT)
    assert reads.poll() == [] and len(reads) == 1 and not wake.is_set()
    gate.release.set()
    assert wake.wait(WAIT)  # the helper wakes the engine when it is done
    [fetched] = reads.poll()
    assert fetched.seq is seq and fetched.data == b"A" * 1000 and len(reads) == 0
    assert gate.threads == ["disk-read"]


def test_sequences_that_want_one_entry_share_one_read(tmp_path: Path) -> None:
    tier = tier_with(tmp_path, A)
    gate = Gate()
    reads, wake = reads_for(tier, gate)
    seqs = [Sequence(Job(prompt=A + [i])) for i in range(3)]
    for seq in seqs:
        reads.start(seq, entry_of(tier, A))
    gate.release.set()
    assert wake.wait(WAIT)
    done = reads.poll()
    assert [f.seq for f in done] == seqs and {f.data for f in done} == {b"A" * 1000}
    assert gate.calls == 1


def test_a_corrupt_entry_gives_no_bytes_and_goes(tmp_path: Path) -> None:
    tier = tier_with(tmp_path, A)
    entry = entry_of(tier, A)
    raw = bytearray(entry.path.read_bytes())
    raw[-1] ^= 0xFF
    entry.path.write_bytes(bytes(raw))
    gate = Gate()
    gate.release.set()
    reads, wake = reads_for(tier, gate)
    reads.start(Sequence(Job(prompt=A)), entry)
    assert wake.wait(WAIT)
    [fetched] = reads.poll()
    assert fetched.data is None and tier.rejected == 1 and not entry.path.exists()


def test_a_reader_that_raises_costs_the_prefix_only(tmp_path: Path) -> None:
    tier = tier_with(tmp_path, A)

    def broken(tier: DiskTier, entry: DiskEntry) -> Read:
        raise OSError("the device went away")

    wake = threading.Event()
    reads = DiskReads(tier, wake.set, broken)
    reads.start(Sequence(Job(prompt=A)), entry_of(tier, A))
    assert wake.wait(WAIT)
    [fetched] = reads.poll()
    assert fetched.data is None


def test_a_read_past_its_deadline_gives_up_and_stops_other_reads(tmp_path: Path) -> None:
    tier = tier_with(tmp_path, A, B)
    gate, clock = Gate(), Clock()
    reads, wake = reads_for(tier, gate, clock=clock, grace=5.0, rate=1000.0)
    seq = Sequence(Job(prompt=A))
    entry = entry_of(tier, A)
    reads.start(seq, entry)
    assert gate.started.wait(WAIT)
    clock.now += 5.0 + entry.size / 1000.0 - 0.01
    assert reads.poll() == []  # within its bound: it still waits
    clock.now += 0.01
    [fetched] = reads.poll()
    assert fetched.seq is seq and fetched.data is None and reads.timeouts == 1
    assert not reads.open  # a hung device holds no second request
    gate.release.set()
    assert wake.wait(WAIT)
    assert reads.open and reads.poll() == []  # its late bytes go nowhere


def test_a_cancelled_sequence_leaves_without_its_read(tmp_path: Path) -> None:
    tier = tier_with(tmp_path, A)
    gate = Gate()
    reads, _ = reads_for(tier, gate)
    seq = Sequence(Job(prompt=A))
    reads.start(seq, entry_of(tier, A))
    seq.job.cancel()
    [fetched] = reads.poll()
    assert fetched.seq is seq and fetched.data is None and len(reads) == 0
    gate.release.set()


def test_the_placer_places_others_while_a_read_runs(tmp_path: Path) -> None:
    """A sequence whose prefix is on disk leaves the queue for its read; the one behind
    it is placed at once; the first comes back with the bytes and restores them."""
    tier = tier_with(tmp_path, A)
    gate = Gate()
    reads, wake = reads_for(tier, gate)
    placer = Placer(4096, PrefixCaches(PromptCache(budget=0), tier), reads=reads)
    first, second = Sequence(Job(prompt=A + [1])), Sequence(Job(prompt=B))
    placer.add(first)
    placer.add(second)
    slots = [Slot(seq_id=0, num_ctx=4096), Slot(seq_id=1, num_ctx=4096)]
    p = placer.next(slots)
    assert isinstance(p, Placement) and p.seq is second and p.source is Source.NONE
    assert placer.next(slots) is None and placer.queued() == 1 and not placer.waiting
    gate.release.set()
    assert wake.wait(WAIT)
    p = placer.next(slots)
    assert isinstance(p, Placement) and p.seq is first and p.source is Source.RESTORE
    assert p.data == b"A" * 1000 and p.n_prefix == len(A) and placer.queued() == 0
    assert gate.calls == 1


def test_a_truncated_entry_read_in_the_helper_gives_a_cold_placement(tmp_path: Path) -> None:
    tier = tier_with(tmp_path, A)
    entry = entry_of(tier, A)
    entry.path.write_bytes(entry.path.read_bytes()[:-10])  # truncated after indexing
    gate = Gate()
    gate.release.set()
    reads, wake = reads_for(tier, gate)
    placer = Placer(4096, PrefixCaches(PromptCache(budget=0), tier), reads=reads)
    placer.add(Sequence(Job(prompt=A + [1])))
    slots = [Slot(seq_id=0, num_ctx=4096)]
    assert placer.next(slots) is None
    assert wake.wait(WAIT)
    p = placer.next(slots)
    assert isinstance(p, Placement) and p.source is Source.NONE and p.n_prefix == 0
    assert gate.calls == 1 and tier.rejected == 1
