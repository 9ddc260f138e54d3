"""Reads of the prompt cache's disk tier, off the engine thread.

A prefix on disk is tens of megabytes to read and hash. On the engine thread that read
would stall every other slot's decode, so a sequence whose best prefix is on disk
waits here instead, off the placer's queue, while a helper thread reads and
verifies the entry (runner.cache.diskcache `DiskTier.read`: the bytes llama_state_seq_set_data
will be given). The helper tells the engine thread it is done through the engine's
command queue (`wake`), so an engine that waits for work wakes; the placer collects
finished reads at each admission (`poll`), and the sequence goes back to the front of
the queue with its bytes, which the engine thread places (one thread per llama
context: set_data stays there).

    WAITING --disk hit--> reading here --read, or not--> WAITING, with the bytes or without

A read that fails, finds a corrupt, truncated or swapped entry, or misses its deadline
gives no bytes: the sequence is placed as if the tier had not had it (cold, or from
RAM or another slot), which is what a request gets from a tier without the entry.
Sequences that want one entry at once share one read. A cancelled sequence leaves at
the next poll, its read left to finish alone.

The deadline is READ_GRACE seconds plus the entry's size at READ_RATE bytes a second:
15 s for a 50 MB entry. The grace covers a disk waking from sleep (a laptop drive
spins up in 3-10 s) and a busy machine; the rate is well below the sequential read of
any disk a laptop has (a hard disk reads 80-150 MB/s, SSDs 500 MB/s and more), so only
a stuck or failing device, or a network mount that hangs, misses it. Missing it costs
the request a wait of that bound once, and then only its prefill. A read past its
deadline is left running (nothing interrupts a blocked read); until it returns no other
read starts (`open` is false: lookups skip the disk), so a hung device holds one
request for one deadline, not each request for its own, and leaves one thread behind.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from corral.runner.cache.diskcache import DiskEntry, DiskTier, Read
from corral.runner.prefix import Checkpoints

if TYPE_CHECKING:
    from corral.runner.slots.sequence import Sequence

log = logging.getLogger("corral.diskread")

READ_GRACE = 10.0  # seconds any read may take (see the module's docstring)
READ_RATE = 10e6  # bytes a second a read must at least go at, past the grace

# How a helper reads an entry; a seam for tests, which hold a read to watch the others.
Reader = Callable[[DiskTier, DiskEntry], Read]


def read_entry(tier: DiskTier, entry: DiskEntry) -> Read:
    return tier.read(entry)


def reads_for(tier: DiskTier | None, wake: Callable[[], None],
              reader: Reader = read_entry) -> "DiskReads | None":
    """The reads of a disk tier, when there is one; `wake` is called on the helper
    thread when a read is over (the engine puts a PrefixRead on its command queue)."""
    return DiskReads(tier, wake, reader) if tier is not None else None


@dataclass(eq=False)
class Flight:
    """One entry being read, for every sequence that waits for it."""

    entry: DiskEntry
    started: float
    deadline: float
    done: threading.Event = field(default_factory=threading.Event)
    result: Read | None = None  # set on the helper thread before `done`
    settled: bool = False  # the tier has been told how it went (engine thread)


@dataclass(frozen=True)
class Fetched:
    """A finished read as the placer gets it: the bytes, or None (go without)."""

    seq: "Sequence"
    entry: DiskEntry
    data: bytes | None
    checkpoints: Checkpoints = ()  # the slot's (runner.prefix Cuts), read with the state


class DiskReads:
    """The reads in flight, keyed by the sequences that wait for them. Every method is
    the engine thread's; only the helper threads' `_work` runs elsewhere."""

    def __init__(self, tier: DiskTier, wake: Callable[[], None] = lambda: None,
                 reader: Reader = read_entry, clock: Callable[[], float] = time.monotonic,
                 grace: float = READ_GRACE, rate: float = READ_RATE) -> None:
        self.tier, self._wake, self._reader, self._clock = tier, wake, reader, clock
        self.grace, self.rate = grace, rate
        self._flights: dict[int, Flight] = {}  # id(entry) -> its read
        self._waiting: dict[int, tuple["Sequence", Flight]] = {}  # id(seq) -> its read
        self._stuck: list[Flight] = []  # past their deadline, still running
        self.timeouts = 0

    def __len__(self) -> int:
        return len(self._waiting)

    @property
    def open(self) -> bool:
        """Whether a read may start: none that missed its deadline is still running."""
        self._stuck = [f for f in self._stuck if not f.done.is_set()]
        return not self._stuck

    def start(self, seq: "Sequence", entry: DiskEntry) -> None:
        """`seq` waits for `entry`'s bytes, read by a helper (one read per entry)."""
        flight = self._flights.get(id(entry))
        if flight is None:
            now = self._clock()
            flight = Flight(entry, now, now + self.grace + entry.size / self.rate)
            self._flights[id(entry)] = flight
            threading.Thread(target=self._work, args=(flight,), name="disk-read",
                             daemon=True).start()
        self._waiting[id(seq)] = (seq, flight)

    def poll(self) -> list[Fetched]:
        """The sequences whose wait is over, each with its bytes or None: read (or not),
        past the deadline, or cancelled. Never blocks."""
        now, out = self._clock(), []
        for key, (seq, flight) in list(self._waiting.items()):
            if flight.done.is_set():
                data = self._settle(flight)
                assert flight.result is not None
                out.append(Fetched(seq, flight.entry, data,
                                   flight.result.checkpoints if data is not None else ()))
            elif seq.job.cancelled.is_set():
                out.append(Fetched(seq, flight.entry, None))
            elif now >= flight.deadline:
                if flight not in self._stuck:
                    log.warning("prompt cache read of %s took over %.1f s: going without it",
                                flight.entry.path.name, now - flight.started)
                    self._stuck.append(flight)
                    self.timeouts += 1
                self._flights.pop(id(flight.entry), None)
                out.append(Fetched(seq, flight.entry, None))
            else:
                continue
            del self._waiting[key]
        live = {id(f) for _, f in self._waiting.values()}
        for key, flight in list(self._flights.items()):  # no one waits: let it finish alone
            if id(flight) not in live:
                del self._flights[key]
        return out

    def abandon(self) -> list["Sequence"]:
        """Every waiting sequence, which no longer waits (the engine is stopping)."""
        seqs = [seq for seq, _ in self._waiting.values()]
        self._waiting.clear()
        self._flights.clear()
        return seqs

    def _settle(self, flight: Flight) -> bytes | None:
        """The flight's bytes, settled with the tier once (on the engine thread)."""
        assert flight.result is not None
        if not flight.settled:
            flight.settled = True
            self._flights.pop(id(flight.entry), None)
            flight.result = Read(self.tier.settle(flight.entry, flight.result),
                                 flight.result.problem, flight.result.checkpoints)
        return flight.result.data

    def _work(self, flight: Flight) -> None:
        """On a helper thread: read, then wake the engine thread."""
        try:
            result = self._reader(self.tier, flight.entry)
        except Exception as exc:  # a bug or a seam's failure costs the prefix, not the request
            log.exception("prompt cache read failed")
            result = Read(None, f"read failed: {exc}")
        flight.result = result
        flight.done.set()
        self._wake()
