"""The engine's typed boundary: the job a caller submits, the commands the engine
thread reads, and the events a job's caller reads back.

    caller --Submit/Embed/Stop/SetThreads/ClearCache--> engine thread --Token*, then Done or Failed--> job.events
    growth builder --Resized--> engine thread
    disk tier reader --PrefixRead--> engine thread
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Sequence, Union

from corral.errors import CorralError
from corral.options import Options
from corral.runner.wire import DoneLine, Logprob

if TYPE_CHECKING:
    import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    """Ollama's per-request sampling options, with Ollama's defaults (its DefaultOptions:
    tests/test_ollama_defaults.py reads them from Ollama's source, field by field).
    repeat_penalty is 1.0, no penalty, as Ollama's has been since August 2026; a model
    that wants one says so in its parameters."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.9
    min_p: float = 0.0
    typical_p: float = 1.0
    repeat_last_n: int = 64
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = -1

    @classmethod
    def from_options(cls, options: Options) -> "SamplingParams":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in options.values().items() if k in names})

    def penalized(self) -> bool:
        return self.repeat_last_n != 0 and (
            self.repeat_penalty != 1.0 or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0)


@dataclass(frozen=True)
class ImageSpan:
    """One image (or audio window) in a prompt: `n_tokens` placeholders from index `start`.

    With M-RoPE (Qwen2-VL and later) an image's tokens take 2-D positions: all of them
    the image's first position in time, and a column and a row from its `grid`, so the
    image takes `n_pos` = max(columns, rows) positions and the text after it continues
    there, not at its token count (llama.cpp's mtmd_image_tokens_get_decoder_pos)."""

    start: int
    key: int  # the placeholder id: negative, from the image's hash
    embd: "np.ndarray"  # float32 (n_tokens, n_embd)
    non_causal: bool  # its tokens attend to each other both ways: decoded in one batch
    n_pos: int = 0  # positions it takes, where not one per token (M-RoPE images)
    grid: "tuple[int, int] | None" = None  # (columns, rows) of an M-RoPE image's tokens

    @property
    def n_tokens(self) -> int:
        return int(self.embd.shape[0])

    @property
    def end(self) -> int:
        return self.start + self.n_tokens

    @property
    def positions(self) -> int:
        return self.n_pos or self.n_tokens

    @property
    def whole(self) -> bool:
        """Whether a cached prefix must hold all of it or none: its tokens attend both
        ways, or share one position in time (M-RoPE), which no cut of the KV can split."""
        return self.non_causal or self.grid is not None

    def shifted(self, offset: int) -> "ImageSpan":
        return replace(self, start=self.start + offset)


def position(spans: "Sequence[ImageSpan]", index: int) -> int:
    """The position of the prompt's token `index` (or of the token that would follow):
    its index, less what the M-RoPE images before it save; an image's tokens all sit
    at its first position (in time, the KV's own position). Without M-RoPE, the index."""
    saved = 0
    for span in spans:
        if index < span.start:
            break
        if index < span.end and span.grid is not None:
            return span.start - saved
        if index >= span.end:
            saved += span.n_tokens - span.positions
    return index - saved


@dataclass(frozen=True)
class Token:
    text: str
    logprobs: tuple[Logprob, ...] = ()  # one per token in `text`, when asked for


@dataclass(frozen=True)
class Done:
    stats: DoneLine  # done_reason, counts and durations, the context


@dataclass(frozen=True)
class Failed:
    error: CorralError


JobEvent = Union[Token, Done, Failed]


@dataclass
class Job:
    """One generation request as the engine sees it."""

    prompt: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    num_predict: int = -1
    stop: list[str] = field(default_factory=list)
    num_keep: int = 4
    grammar: str | None = None
    truncate: bool = True
    shift: bool = True
    ignore_eos: bool = False  # benchmarks: always generate num_predict tokens
    logprobs: int = -1  # -1: none; else alternatives per token (0-20)
    special: bool = False  # render control tokens as text (gpt-oss's harmony markers)
    images: "tuple[ImageSpan, ...]" = ()  # where the prompt's placeholder ids are images
    # Chunks of at least this many cached tokens past the common prefix are shifted into
    # place instead of evaluated again (llama-server's --cache-reuse); 0: exact reuse only.
    reuse_chunk: int = 0
    return_context: bool = True  # the Done line carries the prompt's and reply's tokens
    id: str = ""
    events: "queue.Queue[JobEvent]" = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = 0.0  # set by the engine, on its clock

    def cancel(self) -> None:
        self.cancelled.set()


@dataclass(frozen=True)
class Submit:
    job: Job


@dataclass(frozen=True)
class Embed:
    """Inputs to embed; the engine works through them a slice per step, between decodes."""

    inputs: list[list[int]]
    truncate: bool
    reply: "queue.Queue[list[list[float]] | Failed]" = field(default_factory=queue.Queue)
    id: str = ""
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled.set()


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class Resized:
    """A context of `streams` KV streams, made off the engine thread for it to adopt
    (runner.kv.growth); `ctx` is None when it could not be made."""

    ctx: Any
    streams: int


@dataclass(frozen=True)
class SetThreads:
    """Threads for decoding from now on: the daemon's share of the cores."""

    n: int


@dataclass(frozen=True)
class ClearCache:
    """Drop the prompt cache's RAM: the daemon wants the memory for another model."""


@dataclass(frozen=True)
class PrefixRead:
    """A read of the prompt cache's disk tier is over (runner.cache.diskread): it wakes an engine
    that waits for work, so the sequence waiting for the read is placed."""


Command = Union[Submit, Embed, Stop, Resized, SetThreads, ClearCache, PrefixRead]


class Inbox:
    """The engine thread's command queue. Once the loop has ended, `close` answers what is
    still queued with its reason, and a later Submit or Embed is refused with it, so that
    no caller waits on a queue nobody reads."""

    def __init__(self) -> None:
        self._queue: queue.Queue[Command] = queue.Queue()
        self._gate = threading.Lock()
        self.closed: CorralError | None = None

    def put(self, command: Command) -> None:
        with self._gate:
            if self.closed is not None and isinstance(command, (Submit, Embed)):
                raise self.closed
            self._queue.put(command)

    def get(self, timeout: float = 0.0) -> Command:
        """The next command; queue.Empty after `timeout` seconds (0: at once)."""
        return self._queue.get(timeout=timeout) if timeout > 0 else self._queue.get_nowait()

    def qsize(self) -> int:
        return self._queue.qsize()

    def close(self, error: CorralError) -> None:
        with self._gate:
            self.closed = error
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, Submit):
                item.job.events.put(Failed(error))
            elif isinstance(item, Embed):
                item.reply.put(Failed(error))
