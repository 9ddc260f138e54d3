"""Images into prompts: the projector (llama.cpp's mtmd library) and its own thread.

The projector context is used by one thread, like the llama context: request
threads hand it a Prepare (prompt text with one media marker per image, and the
images' bytes) and wait on its reply. It tokenizes the text around the markers,
encodes each image it has not seen recently into embeddings, and replies with

    tokens  the prompt, where each image token is a negative placeholder id
            derived from the image's hash: the engine's prefix match then
            compares images by content, exactly as it compares text tokens;
    spans   where each image sits and its embeddings, which the engine decodes
            into the slot's own sequence between steps.

Encoding runs here, off the engine thread, so running streams keep decoding
while an image is encoded; a recently seen image is not encoded again.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import queue
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from corral.errors import BadRequest, CorralError, RunnerError
from corral.runner.jobs import ImageSpan
from corral.runner.wire import MARKER

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger("corral.vision")

CACHE_BYTES = 64 << 20  # encoded images kept for follow-up questions
_TEXT, _IMAGE = 0, 1
_log_hook: Any = None


def placeholder(digest: bytes) -> int:
    return -1 - int.from_bytes(digest[:7], "big")


@dataclass
class Prepare:
    text: str
    images: list[bytes]
    add_special: bool
    reply: "queue.Queue[tuple[list[int], list[ImageSpan]] | CorralError]" = field(
        default_factory=queue.Queue)


def _quiet_logs() -> None:
    """mtmd and clip log through their own hook, loudly, at every load and image."""
    global _log_hook
    from llama_cpp import llama_cpp as L
    from llama_cpp import mtmd_cpp as M

    if _log_hook is None:
        _log_hook = L.llama_log_callback(lambda level, text, user: None)
        M.mtmd_helper_log_set(_log_hook, ctypes.c_void_p(0))


class Vision:
    """A projector loaded beside a text model; `prepare` is safe from any thread."""

    def __init__(self, projector: str, model: Any, n_threads: int, use_gpu: bool = False,
                 cache_bytes: int = CACHE_BYTES) -> None:
        from llama_cpp import mtmd_cpp as M

        self._m = M
        _quiet_logs()
        params = M.mtmd_context_params_default()
        params.use_gpu = use_gpu
        params.n_threads = n_threads
        params.print_timings = False
        params.warmup = False
        params.media_marker = MARKER.encode()
        self.ctx = M.mtmd_init_from_file(projector.encode(), model, params)
        if not self.ctx:
            raise RunnerError(f"llama.cpp could not load the projector {projector}: it is not"
                              " a vision projector for this model")
        if not M.mtmd_support_vision(self.ctx):
            self._free()
            raise RunnerError("the projector has no vision encoder")
        if M.mtmd_decode_use_mrope(self.ctx):
            self._free()
            raise RunnerError("projectors with M-RoPE positions (Qwen2-VL and later) are not"
                              " supported yet")
        self.non_causal = bool(M.mtmd_decode_use_non_causal(self.ctx, None))
        from llama_cpp import llama_cpp as L

        self.n_embd = int(L.llama_model_n_embd_inp(model))  # what mtmd checked it against
        self.encoded = 0  # images encoded since load (a cache hit does not count)
        self._cache: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._cache_bytes, self._cache_limit = 0, cache_bytes
        self._queue: queue.Queue[Prepare | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="vision", daemon=True)
        self._thread.start()

    def prepare(self, text: str, images: list[bytes], add_special: bool
                ) -> tuple[list[int], list[ImageSpan]]:
        if text.count(MARKER) != len(images):
            raise BadRequest(f"the prompt has {text.count(MARKER)} image markers for"
                             f" {len(images)} images")
        request = Prepare(text, images, add_special)
        self._queue.put(request)
        result = request.reply.get()
        if isinstance(result, CorralError):
            raise result
        return result

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)
        if not self._thread.is_alive():
            self._free()

    # ---- the vision thread ---------------------------------------------------------------

    def _run(self) -> None:
        while True:
            request = self._queue.get()
            if request is None:
                return
            try:
                request.reply.put(self._prepare(request))
            except CorralError as exc:
                request.reply.put(exc)
            except Exception as exc:  # a bug here must not leave a client hanging
                log.exception("preparing images failed")
                request.reply.put(RunnerError(f"preparing images failed: {exc}"))

    def _prepare(self, request: Prepare) -> tuple[list[int], list[ImageSpan]]:
        M = self._m
        bitmaps = [self._bitmap(data, i) for i, data in enumerate(request.images)]
        chunks = M.mtmd_input_chunks_init()
        try:
            raw = request.text.encode("utf-8", "surrogatepass")
            text = M.mtmd_input_text()
            text.text, text.text_len = raw, len(raw)
            text.add_special, text.parse_special = request.add_special, True
            handles = (M.mtmd_bitmap_p_ctypes * max(len(bitmaps), 1))(*bitmaps)
            rc = M.mtmd_tokenize(self.ctx, chunks, ctypes.byref(text), handles, len(bitmaps))
            if rc != 0:
                raise BadRequest(f"the prompt and its images could not be tokenized ({rc})")
            return self._collect(chunks, request.images)
        finally:
            M.mtmd_input_chunks_free(chunks)
            for bitmap in bitmaps:
                M.mtmd_bitmap_free(bitmap)

    def _bitmap(self, data: bytes, index: int) -> Any:
        M = self._m
        buf = (ctypes.c_ubyte * len(data)).from_buffer_copy(data)
        bitmap = M.mtmd_helper_bitmap_init_from_buf(self.ctx, buf, len(data), False)
        if not bitmap:
            raise BadRequest(f"image {index} could not be decoded: it is truncated, corrupt"
                             " or not an image")
        return bitmap

    def _collect(self, chunks: Any, images: list[bytes]) -> tuple[list[int], list[ImageSpan]]:
        M = self._m
        tokens: list[int] = []
        spans: list[ImageSpan] = []
        for i in range(M.mtmd_input_chunks_size(chunks)):
            chunk = M.mtmd_input_chunks_get(chunks, i)
            kind = M.mtmd_input_chunk_get_type(chunk)
            if kind == _TEXT:
                n = ctypes.c_size_t()
                ids = M.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                tokens.extend(int(ids[k]) for k in range(n.value))
            elif kind == _IMAGE:
                digest = hashlib.sha256(images[len(spans)]).digest()
                embd = self._embeddings(chunk, digest)
                key = placeholder(digest)
                spans.append(ImageSpan(len(tokens), key, embd, self.non_causal))
                tokens.extend([key] * embd.shape[0])
            else:
                raise BadRequest("only images are supported as media")
        return tokens, spans

    def _embeddings(self, chunk: Any, digest: bytes) -> np.ndarray:
        cached = self._cache.get(digest)
        if cached is not None:
            self._cache.move_to_end(digest)
            return cached
        import numpy as np  # here, at the first image: importing this module stays cheap

        M = self._m
        n_tokens = int(M.mtmd_input_chunk_get_n_tokens(chunk))
        if M.mtmd_encode_chunk(self.ctx, chunk) != 0:
            raise RunnerError("the projector could not encode the image")
        out = M.mtmd_get_output_embd(self.ctx)
        n_embd = self.n_embd
        embd = np.ctypeslib.as_array(out, shape=(n_tokens * n_embd,)).reshape(
            n_tokens, n_embd).copy()
        self.encoded += 1
        self._remember(digest, embd)
        return embd

    def _remember(self, digest: bytes, embd: np.ndarray) -> None:
        self._cache[digest] = embd
        self._cache_bytes += embd.nbytes
        while self._cache_bytes > self._cache_limit and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._cache_bytes -= old.nbytes

    def _free(self) -> None:
        if self.ctx:
            self._m.mtmd_free(self.ctx)
            self.ctx = None
