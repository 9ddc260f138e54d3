"""The engine: one llama.cpp context, fixed slots, continuous batching.

Exactly one thread (the engine thread) touches the model's context. Requests
arrive on a queue; each request's results leave on its own queue as events:
("token", text), then ("done", stats) or ("error", message).

Each step builds one llama_batch: the next token of every decoding slot first,
then prompt chunks of prefilling slots within the n_batch budget. Every batch
and index is checked before it reaches native code, because llama.cpp aborts
the whole process on misuse instead of raising.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import llama_cpp as L

from api.errors import BadRequest, RunnerError
from runner import native
from runner.embedding import Embedder
from runner.sampling import Sampler
from runner.slot import DoneReason, Job, Slot, SlotState, common_prefix
from runner.textstream import Utf8Stream

log = logging.getLogger("corral.engine")


@dataclass(frozen=True)
class EngineConfig:
    n_slots: int = 1
    num_ctx: int = 4096  # per slot
    n_batch: int = 512
    n_threads: int = 0  # 0: physical cores
    n_gpu_layers: int = 0
    flash_attn: bool | None = None
    kv_cache_type: str = "f16"
    use_mmap: bool = True
    # llama.cpp's extra CPU buffer types (weight repacking, AMX) make a row's
    # logits depend on how many rows share the batch, so greedy output would
    # change with load; on this class of CPU they are not faster either.
    extra_bufts: bool = False


_KV_TYPES = {"f16": L.GGML_TYPE_F16, "q8_0": L.GGML_TYPE_Q8_0, "q4_0": L.GGML_TYPE_Q4_0}


class Engine:
    def __init__(self, model_path: str, config: EngineConfig,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if config.n_slots < 1 or config.n_slots > 256:
            raise BadRequest("slots must be between 1 and 256")
        self.config = config
        self.clock = clock
        self._commands: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._waiting: list[Job] = []
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.steps = 0
        self.step_time = 0.0  # seconds inside _step
        self.native_time = 0.0  # of which in llama_decode and samplers
        native.init_backend()
        t0 = clock()
        self._load(model_path)
        self.load_seconds = clock() - t0
        self.slots = [Slot(seq=i, num_ctx=self.num_ctx) for i in range(config.n_slots)]
        self.embedder = Embedder(self.model, self.num_ctx, self.n_threads)

    # ---- loading (called before the engine thread exists) ---------------------------

    def _load(self, path: str) -> None:
        cfg = self.config
        mparams = L.llama_model_default_params()
        mparams.n_gpu_layers = cfg.n_gpu_layers
        mparams.use_extra_bufts = cfg.extra_bufts
        if not cfg.use_mmap:
            mparams.load_mode = L.LLAMA_LOAD_MODE_NONE
        self.model = L.llama_model_load_from_file(path.encode(), mparams)
        if not self.model:
            raise RunnerError(f"llama.cpp could not load {path}")
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self.n_ctx_train = L.llama_model_n_ctx_train(self.model)
        self.num_ctx = min(cfg.num_ctx, self.n_ctx_train) if self.n_ctx_train > 0 else cfg.num_ctx
        self.n_threads = cfg.n_threads or native.physical_cores()
        cparams = L.llama_context_default_params()
        cparams.n_ctx = self.num_ctx * cfg.n_slots
        cparams.n_seq_max = cfg.n_slots
        cparams.n_batch = cparams.n_ubatch = max(cfg.n_batch, cfg.n_slots)
        cparams.n_threads = cparams.n_threads_batch = self.n_threads
        # One KV stream per slot. In a shared (unified) stream, a sequence's new
        # cells can land in holes another slot left behind, which changes the
        # order flash attention visits them in, and so its floating-point sums:
        # outputs would then depend on the neighbours.
        cparams.kv_unified = False
        # Gemma 3's sliding-window cache must be full size, or prefix reuse and
        # context shift would need KV that has already been evicted.
        cparams.swa_full = True
        cparams.embeddings = False
        cparams.no_perf = True
        fa = cfg.flash_attn
        cparams.flash_attn_type = (L.LLAMA_FLASH_ATTN_TYPE_AUTO if fa is None else
                                   L.LLAMA_FLASH_ATTN_TYPE_ENABLED if fa else
                                   L.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        kv_type = _KV_TYPES.get(cfg.kv_cache_type, L.GGML_TYPE_F16)
        cparams.type_k = cparams.type_v = kv_type
        self.ctx = L.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            L.llama_model_free(self.model)
            raise RunnerError("llama.cpp could not create a context (out of memory?)")
        self.mem = L.llama_get_memory(self.ctx)
        self.n_batch = int(L.llama_n_batch(self.ctx))
        self.n_ctx = int(L.llama_n_ctx(self.ctx))
        self.can_shift = bool(L.llama_memory_can_shift(self.mem))
        self.batch = L.llama_batch_init(self.n_batch, 0, 1)
        self.add_bos = bool(L.llama_vocab_get_add_bos(self.vocab))
        self.eog_tokens = [t for t in range(self.n_vocab) if L.llama_vocab_is_eog(self.vocab, t)]
        self._eog = frozenset(self.eog_tokens)  # a set lookup on the per-token path

    # ---- public API, safe from any thread ---------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> Job:
        if self._stopping:
            raise RunnerError("engine is shutting down")
        if not job.prompt:
            raise BadRequest("empty prompt")
        if any(t < 0 or t >= self.n_vocab for t in job.prompt):
            raise BadRequest("prompt contains invalid token ids")
        self._commands.put(("job", job))
        return job

    def embed(self, inputs: list[list[int]], truncate: bool = True) -> list[list[float]]:
        reply: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._commands.put(("embed", (inputs, truncate, reply)))
        kind, value = reply.get()
        if kind == "error":
            raise value
        return list(value)

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        # llama_tokenize only reads the vocab, which is safe from any thread.
        return native.tokenize(self.vocab, text, add_special and self.add_bos)

    def detokenize(self, tokens: list[int]) -> str:
        stream = Utf8Stream()
        return "".join(stream.feed(native.token_bytes(self.vocab, t))
                       for t in tokens if 0 <= t < self.n_vocab) + stream.flush()

    def status(self) -> dict[str, int]:
        slots = self.slots
        return {
            "slots": len(slots),
            "busy_slots": sum(s.state is not SlotState.IDLE for s in slots),
            "waiting": len(self._waiting) + self._commands.qsize(),
            "kv_used": sum(s.n_past for s in slots),
            "kv_reserved": self.n_ctx,
        }

    def stop(self) -> None:
        self._stopping = True
        self._commands.put(("stop", None))
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._free()

    # ---- the engine thread ---------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping:
                busy = any(s.state is not SlotState.IDLE for s in self.slots)
                self._drain(block=not busy and not self._waiting)
                if self._stopping:
                    break
                self._reap_cancelled()
                self._admit()
                if any(s.state is not SlotState.IDLE for s in self.slots):
                    t0 = self.clock()
                    self._step()
                    self.step_time += self.clock() - t0
                    self.steps += 1
        except Exception as exc:  # a bug here must not leave clients hanging
            log.exception("engine thread failed")
            self._fail_everyone(f"engine failed: {exc}")
        finally:
            self._fail_everyone("runner is shutting down")

    def _drain(self, block: bool) -> None:
        try:
            item = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, value = item
            if kind == "job":
                self._waiting.append(value)
            elif kind == "embed":
                inputs, truncate, reply = value
                try:
                    reply.put(("ok", self.embedder.embed(inputs, truncate)))
                except Exception as exc:  # noqa: BLE001 - returned to the caller
                    reply.put(("error", exc))
            elif kind == "stop":
                self._stopping = True
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _reap_cancelled(self) -> None:
        # A queued request whose client has gone is dropped without running.
        for job in [j for j in self._waiting if j.cancelled.is_set()]:
            self._waiting.remove(job)
            job.events.put(("done", {"done_reason": DoneReason.CANCEL.value}))
        for slot in self.slots:
            if slot.job is not None and slot.job.cancelled.is_set():
                self._finish(slot, DoneReason.CANCEL)

    def _admit(self) -> None:
        while self._waiting:
            idle = [s for s in self.slots if s.state is SlotState.IDLE]
            if not idle:
                return
            job = self._waiting.pop(0)
            try:
                self._prepare(job, idle)
            except BadRequest as exc:
                job.events.put(("error", exc.message))

    def _prepare(self, job: Job, idle: list[Slot]) -> None:
        prompt = self._fit_prompt(job)
        job.prompt = prompt
        # The idle slot sharing the longest prefix wins; ties go to the least recently used.
        keep, _, slot = max(((common_prefix(s.cached, prompt), -s.last_used, s) for s in idle),
                            key=lambda c: (c[0], c[1]))
        # At least one prompt token must be decoded to get logits.
        keep = min(keep, len(prompt) - 1)
        if keep == 0 or not L.llama_memory_seq_rm(self.mem, slot.seq, keep, -1):
            L.llama_memory_seq_rm(self.mem, slot.seq, -1, -1)
            keep = 0
        sampler = Sampler(job.params, self.vocab, self.n_vocab, self.num_ctx, job.grammar,
                          self.eog_tokens if job.ignore_eos else None)
        if job.params.penalized():
            sampler.remember(prompt[-max(job.params.repeat_last_n, 0) or None:])
        slot.start(job, keep, sampler, self._limit(job, len(prompt)))

    def _fit_prompt(self, job: Job) -> list[int]:
        prompt, n_ctx = job.prompt, self.num_ctx
        if len(prompt) < n_ctx:
            return prompt
        if not job.truncate:
            raise BadRequest(
                f"the input length ({len(prompt)} tokens) exceeds the context length ({n_ctx})")
        keep = max(0, min(job.num_keep if job.num_keep >= 0 else len(prompt), n_ctx // 2))
        tail = n_ctx - keep - 1
        return prompt[:keep] + prompt[len(prompt) - tail:]

    def _limit(self, job: Job, n_prompt: int) -> int:
        if job.num_predict == -2:
            return max(1, self.num_ctx - n_prompt)
        if job.num_predict < 0:
            return 10 * self.num_ctx
        return max(job.num_predict, 0)

    # ---- one step ----------------------------------------------------------------------

    def _step(self) -> None:
        for slot in self.slots:
            if slot.state is SlotState.DECODE and slot.n_past >= self.num_ctx:
                self._make_room(slot)
        batch = self.batch
        batch.n_tokens = 0
        decoding = [s for s in self.slots if s.state is SlotState.DECODE]
        prefilling = sorted((s for s in self.slots if s.state is SlotState.PREFILL),
                            key=lambda s: s.t_start)
        for slot in decoding:
            slot.i_batch = self._add(slot.last_token, slot.n_past, slot.seq, True)
        taken: dict[int, int] = {}
        for slot in prefilling:
            budget = self.n_batch - batch.n_tokens
            if budget <= 0:
                break
            take = min(budget, len(slot.pending))
            last_chunk = take == len(slot.pending)
            for k in range(take):
                idx = self._add(slot.pending[k], slot.n_past + k, slot.seq,
                                last_chunk and k == take - 1)
            slot.i_batch = idx if last_chunk else -1
            taken[slot.seq] = take
        if batch.n_tokens == 0:
            return
        t0 = self.clock()
        rc = L.llama_decode(self.ctx, batch)
        self.native_time += self.clock() - t0
        if rc != 0:
            self._decode_failed(rc, decoding + [s for s in prefilling if s.seq in taken])
            return
        for slot in prefilling:
            n = taken.get(slot.seq, 0)
            if n:
                slot.cached.extend(slot.pending[:n])
                del slot.pending[:n]
                if not slot.pending:
                    slot.transition(SlotState.DECODE)
                    slot.t_first = self.clock()
                    self._sample(slot)
        for slot in decoding:
            if slot.state is SlotState.DECODE:
                slot.cached.append(slot.last_token)
                self._sample(slot)

    def _add(self, token: int, pos: int, seq: int, logits: bool) -> int:
        batch = self.batch
        i = batch.n_tokens
        if i >= self.n_batch:
            raise RuntimeError("batch overflow")  # never reaches llama_decode's abort
        batch.token[i] = token
        batch.pos[i] = pos
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = seq
        batch.logits[i] = logits
        batch.n_tokens = i + 1
        return i

    def _sample(self, slot: Slot) -> None:
        assert slot.sampler is not None and 0 <= slot.i_batch < self.batch.n_tokens
        assert self.batch.logits[slot.i_batch]
        t0 = self.clock()
        token = slot.sampler.sample(self.ctx, slot.i_batch)
        self.native_time += self.clock() - t0
        slot.n_generated += 1
        slot.last_token = token
        if token in self._eog:
            self._finish(slot, DoneReason.STOP)
            return
        slot.generated.append(token)
        text = slot.utf8.feed(native.token_bytes(self.vocab, token))
        result = slot.stops.feed(text)
        if result.text:
            assert slot.job is not None
            slot.job.events.put(("token", result.text))
        if result.stopped:
            self._finish(slot, DoneReason.STOP, flush=False)
        elif slot.n_generated >= slot.limit:
            self._finish(slot, DoneReason.LENGTH)

    def _make_room(self, slot: Slot) -> None:
        """Context shift: drop half of what follows num_keep, or end with 'length'."""
        job = slot.job
        assert job is not None
        if not (job.shift and self.can_shift) or job.num_predict == -2:
            self._finish(slot, DoneReason.LENGTH)
            return
        keep = max(0, min(job.num_keep, slot.n_past // 2))
        discard = (slot.n_past - keep) // 2
        if discard <= 0:
            self._finish(slot, DoneReason.LENGTH)
            return
        L.llama_memory_seq_rm(self.mem, slot.seq, keep, keep + discard)
        L.llama_memory_seq_add(self.mem, slot.seq, keep + discard, slot.n_past, -discard)
        del slot.cached[keep:keep + discard]

    def _decode_failed(self, rc: int, slots: list[Slot]) -> None:
        log.error("llama_decode returned %d", rc)
        if rc == 1 and self._evict_idle_cache():
            # No KV room: idle slots' cached prefixes were dropped; retry next step.
            for slot in slots:
                L.llama_memory_seq_rm(self.mem, slot.seq, slot.n_past, -1)
            return
        for slot in slots:
            L.llama_memory_seq_rm(self.mem, slot.seq, -1, -1)
            slot.cached = []
            self._fail(slot, f"llama_decode failed ({rc})")

    def _evict_idle_cache(self) -> bool:
        evicted = False
        for slot in self.slots:
            if slot.state is SlotState.IDLE and slot.cached:
                L.llama_memory_seq_rm(self.mem, slot.seq, -1, -1)
                slot.cached = []
                evicted = True
        return evicted

    def _finish(self, slot: Slot, reason: DoneReason, flush: bool = True) -> None:
        job = slot.job
        assert job is not None
        if flush:
            tail = slot.stops.feed(slot.utf8.flush()).text + slot.stops.flush()
            if tail and reason is not DoneReason.CANCEL:
                job.events.put(("token", tail))
        now = self.clock()
        first = slot.t_first or now
        stats = {
            "done_reason": reason.value,
            "prompt_eval_count": slot.n_prompt_eval,
            "prompt_eval_duration": int((first - slot.t_start) * 1e9),
            "eval_count": slot.n_generated,
            "eval_duration": int((now - first) * 1e9),
            "queue_duration": int((slot.t_start - job.submitted) * 1e9),
            "prompt_tokens": len(job.prompt),
            "context": job.prompt + slot.generated,
        }
        slot.release()
        job.events.put(("done", stats))

    def _fail(self, slot: Slot, message: str) -> None:
        job = slot.release()
        if job is not None:
            job.events.put(("error", message))

    def _fail_everyone(self, message: str) -> None:
        for slot in self.slots:
            if slot.job is not None:
                self._fail(slot, message)
        for job in self._waiting:
            job.events.put(("error", message))
        self._waiting.clear()

    def _free(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return  # still inside native code; the process exit will reclaim it
        self.embedder.free()
        if getattr(self, "batch", None) is not None:
            L.llama_batch_free(self.batch)
            self.batch = None
        if self.ctx:
            L.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            L.llama_model_free(self.model)
            self.model = None
