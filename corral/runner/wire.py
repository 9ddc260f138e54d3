"""The runner wire, typed once: what the daemon and a runner process say to each other.

    runner ready line --LoadReport-->  daemon (runner.client; `ps`, templates)
    daemon --CompletionJob (JSON)--> runner /completion --TokenLine lines,
                                     then a DoneLine or an error line
    daemon --EmbedJob--> runner /embed --Embeddings-->
    daemon --GET--> runner /health --Health (with its CacheStats)-->

The daemon builds a CompletionJob from a request's plan (server.pipeline.run) and the
runner client sends it; the runner process reads it back with `from_json`, which
checks every field and coerces the options once. The lines back and the load report
are written from these records and read into them by the client, so nothing past the
wire on either side reads a dict.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from corral.errors import BadRequest
from corral.options import Options
from corral.runner.fim import Infill

# Where each image goes in the prompt text the daemon renders: mtmd's default media
# marker, at which the runner's projector splits the prompt (runner.llama.vision).
MARKER = "<__media__>"


@dataclass(frozen=True)
class CompletionJob:
    prompt: str  # the text the daemon rendered; the runner tokenizes it
    add_bos: bool = True
    images: tuple[str, ...] = ()  # base64, in the order of the prompt's media markers
    context: tuple[int, ...] = ()  # tokens before the text (native /api/generate's context)
    grammar: str | None = None
    options: Options = Options()
    id: str = ""  # for /cancel
    truncate: bool = True
    shift: bool = True
    special: bool = False  # render control tokens as text
    logprobs: int = -1  # -1: none; else alternatives per token
    infill: Infill | None = None  # a FIM prompt the runner assembles, in place of `prompt`
    return_context: bool = False  # the Done line's tokens (/api/generate's context)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "images": list(self.images), "context": list(self.context),
                "options": self.options.values(),
                "infill": None if self.infill is None else self.infill.to_json()}

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> "CompletionJob":
        """A job from the wire: a 400 names the first field that is not what it must be."""
        unknown = set(body) - set(cls.__dataclass_fields__)
        if unknown:
            raise BadRequest(f"unknown job fields: {', '.join(sorted(unknown))}")
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise BadRequest("prompt must be a string")
        images, context = body.get("images") or [], body.get("context") or []
        if not isinstance(images, list) or not all(isinstance(i, str) for i in images):
            raise BadRequest("images must be a list of base64 strings")
        if not isinstance(context, list) or not all(isinstance(t, int) for t in context):
            raise BadRequest("context must be a list of token ids")
        grammar = body.get("grammar")
        if grammar is not None and not isinstance(grammar, str):
            raise BadRequest("grammar must be a string")
        logprobs = body.get("logprobs", -1)
        return cls(prompt=prompt, add_bos=_flag(body, "add_bos", True), images=tuple(images),
                   context=tuple(context), grammar=grammar or None,
                   options=Options.parse(body.get("options")), id=str(body.get("id") or ""),
                   truncate=_flag(body, "truncate", True), shift=_flag(body, "shift", True),
                   special=_flag(body, "special", False),
                   return_context=_flag(body, "return_context", False),
                   logprobs=logprobs if isinstance(logprobs, int) else -1,
                   infill=None if body.get("infill") is None
                   else Infill.from_json(body["infill"]))


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be true or false")
    return value


@dataclass(frozen=True)
class Logprob:
    """One sampled token's log-probability under the model, with the most likely
    alternatives (which carry none of their own)."""

    token: str
    logprob: float
    bytes: tuple[int, ...] = ()
    top: tuple["Logprob", ...] = ()

    def to_json(self, alternatives: bool = True) -> dict[str, Any]:
        """OpenAI chat's entry, which Ollama's `logprobs` also uses."""
        out: dict[str, Any] = {"token": self.token, "logprob": self.logprob,
                               "bytes": list(self.bytes)}
        if alternatives:
            out["top_logprobs"] = [t.to_json(False) for t in self.top]
        return out

    @classmethod
    def from_json(cls, entry: dict[str, Any]) -> "Logprob":
        return cls(str(entry["token"]), float(entry["logprob"]),
                   tuple(int(b) for b in entry.get("bytes") or ()),
                   tuple(cls.from_json(t) for t in entry.get("top_logprobs") or ()))


@dataclass(frozen=True)
class TokenLine:
    """A piece of text the runner sampled, with its log-probabilities when asked."""

    content: str
    logprobs: tuple[Logprob, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"content": self.content, **({"logprobs": [e.to_json() for e in self.logprobs]}
                                            if self.logprobs else {})}


@dataclass(frozen=True)
class DoneLine:
    """A sequence's end: why, and its counts and durations (Ollama's names, ns)."""

    done_reason: str = "stop"
    prompt_tokens: int = 0  # the prompt as sent, cached or not
    prompt_eval_count: int = 0  # of which evaluated (the rest came from a cache)
    prompt_eval_duration: int = 0
    eval_count: int = 0
    eval_duration: int = 0
    queue_duration: int = 0
    context: tuple[int, ...] = ()  # prompt and output tokens (native /api/generate)
    # Speculative decoding: tokens drafted for this sequence (each took a row of a
    # verifying batch), and of those the ones the sampler accepted (each also in
    # eval_count): llama-server's draft_n and draft_n_accepted.
    draft_count: int = 0
    draft_accepted_count: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"done": True, **asdict(self), "context": list(self.context)}

    @classmethod
    def from_json(cls, line: dict[str, Any]) -> "DoneLine":
        def count(name: str) -> int:
            return int(line.get(name) or 0)

        return cls(done_reason=str(line.get("done_reason") or "stop"),
                   prompt_tokens=count("prompt_tokens"),
                   prompt_eval_count=count("prompt_eval_count"),
                   prompt_eval_duration=count("prompt_eval_duration"),
                   eval_count=count("eval_count"), eval_duration=count("eval_duration"),
                   queue_duration=count("queue_duration"),
                   context=tuple(int(t) for t in line.get("context") or ()),
                   draft_count=count("draft_count"),
                   draft_accepted_count=count("draft_accepted_count"))


def read_line(line: dict[str, Any]) -> TokenLine | DoneLine:
    """One line of the runner's stream, typed (error lines are raised before this)."""
    if line.get("done"):
        return DoneLine.from_json(line)
    entries = line.get("logprobs")  # once per token: nothing to build when none were asked
    return TokenLine(str(line.get("content", "")),
                     tuple(map(Logprob.from_json, entries)) if entries else ())


@dataclass(frozen=True)
class LoadReport:
    """What a runner says once loaded: its memory, its sizes, its model's BOS and EOS."""

    weights: int = 0
    kv: int = 0
    compute: int = 0
    gpu_layers: int = 0
    layers: int = 0
    size: int = 0  # bytes at the cap of slots
    size_vram: int = 0
    size_rpc: int = 0
    rpc_servers: tuple[str, ...] = ()
    num_ctx: int = 0  # per slot
    n_ctx: int = 0  # the context's cells now
    slots: int = 0  # the cap (0: no report)
    start_slots: int = 0  # held while idle (elastic KV)
    kv_per_slot: int = 0
    n_threads: int = 0
    load_seconds: float = 0.0
    bos: str = ""  # for the daemon's templates
    eos: str = ""
    can_shift: bool = True
    n_ctx_train: int = 0
    vision: bool = False
    draft: int = 0  # of `weights`, a draft model's bytes and its KV's (0: none drafts)
    draft_error: str = ""  # why the model's draft model did not load ("": it did, or none)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "rpc_servers": list(self.rpc_servers)}

    def held(self, kv: int, cache: int = 0) -> tuple[int, int, int]:
        """What the model holds with `kv` bytes of KV committed and `cache` bytes in its
        prompt cache: (bytes, of which in VRAM, of which on RPC workers). The weights and
        the compute buffer as estimated at load, and the KV and the cache as they are:
        `size` at the cap is this with all of the KV. The KV the model does not hold
        now is taken off the offloaded layers' share in proportion, so a fully offloaded
        model stays all in VRAM; the prompt cache is host RAM."""
        total = self.weights + self.compute + kv + cache
        gone = max(self.kv - kv, 0) * self.gpu_layers // max(self.layers, 1)
        offloaded = self.size_vram + self.size_rpc
        vram_gone = gone * self.size_vram // offloaded if offloaded else 0
        vram = min(max(self.size_vram - vram_gone, 0), total)
        return total, vram, min(max(self.size_rpc - (gone - vram_gone), 0), total - vram)

    @classmethod
    def from_json(cls, report: dict[str, Any]) -> "LoadReport":
        out: dict[str, Any] = {}
        for name in cls.__dataclass_fields__:
            if name in report:
                kind: Any = type(getattr(cls, name))  # the default's type
                out[name] = tuple(str(s) for s in report[name]) if kind is tuple else \
                    kind(report[name])
        return cls(**out)


@dataclass(frozen=True)
class CacheStats:
    """The prompt cache of one runner: what it holds and what it saved (ps, show, /metrics)."""

    bytes: int = 0
    budget: int = 0
    entries: int = 0
    hits: int = 0
    tokens_restored: int = 0
    tokens_shared: int = 0
    disk_bytes: int | None = None  # None: no disk tier
    disk_entries: int | None = None

    def shown(self) -> dict[str, int]:
        """As ps and show carry it: the disk tier's fields only where there is one."""
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class Health:
    """What a runner says of itself now (GET /health)."""

    slots: int = 0  # streams now (elastic KV grows and shrinks them)
    slots_cap: int = 0
    threads: int = 0
    busy_slots: int = 0
    waiting: int = 0  # jobs queued in the runner
    kv_used: int = 0
    kv_reserved: int = 0
    preemptions: int = 0
    sampled: int = 0  # tokens sampled since load
    images_encoded: int = 0
    kv_bytes: int = 0  # KV committed now (runner.kv.growth: Resizer.kv_held)
    reserve_streams: int = 0  # the cap's context made ahead (runner.kv.reserve); 0: none
    # What speculation's draft source holds (the n-gram index; an MTP head's kept states)
    index_bytes: int = 0
    cache: CacheStats = field(default_factory=CacheStats)

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "cache"}
        out.update({f"cache_{k}": v for k, v in self.cache.shown().items()})
        return out

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> "Health":
        """From the runner's flat JSON (the engine's status); absent fields are 0."""
        def number(name: str) -> int:
            return int(body.get(name) or 0)

        cache = CacheStats(**{name: number(f"cache_{name}")
                              for name in CacheStats.__dataclass_fields__
                              if f"cache_{name}" in body})
        return cls(**{name: number(name) for name in cls.__dataclass_fields__
                      if name != "cache"}, cache=cache)


@dataclass(frozen=True)
class EmbedJob:
    """POST /embed: texts to embed, and how."""

    input: tuple[str, ...]
    truncate: bool = True
    normalize: bool = True
    dimensions: int = 0  # keep the first n of each vector (0: all)
    max_tokens: int = 0  # all inputs together (0: no limit)
    id: str = ""  # for /cancel

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "input": list(self.input)}

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> "EmbedJob":
        inputs = body.get("input")
        if isinstance(inputs, str):
            inputs = [inputs]
        if not isinstance(inputs, list) or not all(isinstance(i, str) for i in inputs):
            raise BadRequest("input must be a string or a list of strings")
        dims, limit = body.get("dimensions") or 0, body.get("max_tokens") or 0
        if not isinstance(dims, int) or not isinstance(limit, int) or dims < 0 or limit < 0:
            raise BadRequest("dimensions and max_tokens must be whole numbers, 0 or more")
        return cls(tuple(inputs), _flag(body, "truncate", True), _flag(body, "normalize", True),
                   dims, limit, str(body.get("id") or ""))


@dataclass(frozen=True)
class Embeddings:
    """What /embed answers: a vector per input, and the tokens evaluated for them."""

    embeddings: list[list[float]]
    prompt_eval_count: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"embeddings": self.embeddings, "prompt_eval_count": self.prompt_eval_count}

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> "Embeddings":
        return cls([[float(x) for x in v] for v in body.get("embeddings") or []],
                   int(body.get("prompt_eval_count") or 0))


@dataclass(frozen=True)
class Tokenize:
    """POST /tokenize, as llama-server's: BOS (and EOS) only with `add_special`, control
    tokens' text read as those tokens unless `parse_special` is false, and with
    `with_pieces` each id with its text (TokenPiece)."""

    content: str = ""
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


@dataclass(frozen=True)
class Detokenize:
    """POST /detokenize."""

    tokens: tuple[int, ...] = ()


@dataclass(frozen=True)
class TokenPiece:
    """One token of /tokenize's `with_pieces`: its text, or its bytes where they are not
    valid UTF-8 on their own (part of a character), as llama-server writes them."""

    id: int
    piece: str | list[int]

    @classmethod
    def of(cls, token: int, data: bytes) -> "TokenPiece":
        try:
            return cls(token, data.decode("utf-8"))
        except UnicodeDecodeError:
            return cls(token, list(data))


@dataclass(frozen=True)
class Counted:
    """POST /count's answer: the tokens a CompletionJob's prompt is, as /completion would
    evaluate them from a cold cache (its context, BOS and images included)."""

    prompt_tokens: int = 0


@dataclass(frozen=True)
class Threads:
    """POST /threads: the runner's share of the cores (server.residency.threads)."""

    n: int = 0


@dataclass(frozen=True)
class Cancel:
    """POST /cancel: a job or an embedding batch, by the id it was sent with."""

    id: str = ""


T = TypeVar("T", Tokenize, Detokenize, Threads, Cancel)


def read_command(cls: type[T], body: dict[str, Any]) -> T:
    """A small command from the wire, each field checked against its default's type."""
    values: dict[str, Any] = {}
    for name, spec in cls.__dataclass_fields__.items():
        if name not in body:
            continue
        default, value = spec.default, body[name]
        if isinstance(default, tuple):
            if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
                raise BadRequest(f"{name} must be a list of token ids")
            value = tuple(value)
        elif type(value) is not type(default):  # bool is no int here, nor int a bool
            raise BadRequest(f"{name} must be a {type(default).__name__}")
        values[name] = value
    return cls(**values)
