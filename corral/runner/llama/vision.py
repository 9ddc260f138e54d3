"""Images and audio into prompts: the projector (llama.cpp's mtmd library) and its thread.

The projector context is used by one thread, like the llama context: request
threads hand it a Prepare (prompt text with one media marker per image or audio
clip, and their bytes) and wait on its reply. It tokenizes the text around the
markers, encodes each media chunk it has not seen recently into embeddings (an image
is one chunk, or several tiles; an audio clip one chunk per 30 s window for
Whisper-style encoders), and replies with

    tokens  the prompt, where each media token is a negative placeholder id
            derived from the media's hash and the chunk's place in it: the
            engine's prefix match then compares media by content, exactly as it
            compares text tokens;
    spans   where each chunk sits and its embeddings, which the engine decodes
            into the slot's own sequence between steps (an image span and an
            audio span are the same to it).

Encoding runs here, off the engine thread, so running streams keep decoding
while a chunk is encoded; a recently seen chunk is not encoded again.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import io
import logging
import queue
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

from corral.errors import BadRequest, Cancelled, ContextOverflow, CorralError, RunnerError
from corral.media import audio_format, stb_image, webp
from corral.runner.jobs import ImageSpan
from corral.runner.watch import StepWatch
from corral.runner.wire import MARKER

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger("corral.vision")

CACHE_BYTES = 64 << 20  # encoded chunks kept for follow-up questions, at least
CACHE_MAX = 1 << 30  # and at most: past it a context's media are encoded again


def cache_bytes(num_ctx: int, n_embd: int) -> int:
    """The media cache's size: a whole context's worth of encoded chunks (float32
    embeddings, one row a token), so that a follow-up about the clips and pictures a
    conversation holds finds them all; within CACHE_BYTES and CACHE_MAX."""
    return min(max(CACHE_BYTES, num_ctx * n_embd * 4), CACHE_MAX)
# Seconds a request waits for its media to be decoded and encoded, its place in the
# thread's queue included: ten minutes of audio on a slow CPU fit; a wedged encoder
# does not hold its callers for ever.
PREPARE_TIMEOUT = 600.0
_TEXT, _IMAGE, _AUDIO = 0, 1, 2
_log_hook: Any = None


def _webp_bitmap(M: Any, data: bytes) -> Any:
    """A WebP's first frame as an RGB bitmap; None when it cannot be decoded. Pillow's
    libwebp decodes it here, in the runner, as stb_image reads no WebP: a fault in a
    decoder of untrusted bytes ends this process, which the daemon replaces, and never
    the daemon. Its size was checked from its header before it left the daemon."""
    from PIL import Image  # only a WebP pays for the import

    try:
        with Image.open(io.BytesIO(data), formats=["WEBP"]) as im:
            im.seek(0)
            frame = im.convert("RGB")  # alpha dropped, as stb_image's three channels do
    except (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError):
        return None
    raw = frame.tobytes()
    return M.mtmd_bitmap_init(frame.width, frame.height,
                              (ctypes.c_ubyte * len(raw)).from_buffer_copy(raw))


def _stb_bitmap(M: Any, buf: Any, size: int) -> Any:
    """An RGB bitmap decoded by stb_image, as mtmd's helper decodes an image; None when
    stb_image cannot read it."""
    load, free = _stb(M)
    nx, ny, channels = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    pixels = load(buf, size, ctypes.byref(nx), ctypes.byref(ny), ctypes.byref(channels), 3)
    if not pixels:
        return None
    try:
        return M.mtmd_bitmap_init(nx.value, ny.value, pixels)
    finally:
        free(pixels)


@functools.cache
def _stb(M: Any) -> tuple[Any, Any]:
    """libmtmd's stbi_load_from_memory and stbi_image_free, typed once."""
    load, free = M._libmtmd.stbi_load_from_memory, M._libmtmd.stbi_image_free
    load.restype = ctypes.POINTER(ctypes.c_ubyte)
    load.argtypes = [ctypes.POINTER(ctypes.c_ubyte), ctypes.c_int, ctypes.POINTER(ctypes.c_int),
                     ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    free.argtypes = [ctypes.c_void_p]
    return load, free


def placeholder(digest: bytes) -> int:
    return -1 - int.from_bytes(digest[:7], "big")


@dataclass
class Prepare:
    text: str
    images: list[bytes]
    add_special: bool
    limit: int = 0  # tokens the prompt must stay under (the context); 0: none
    cancelled: threading.Event = field(default_factory=threading.Event)
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
                 num_ctx: int = 0) -> None:
        """`num_ctx`: the context the media cache holds a whole one of (0: CACHE_BYTES)."""
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
        self.vision = bool(M.mtmd_support_vision(self.ctx))
        self.audio = bool(M.mtmd_support_audio(self.ctx))
        if not (self.vision or self.audio):
            self._free()
            raise RunnerError("the projector has no vision or audio encoder")
        self.mrope = bool(M.mtmd_decode_use_mrope(self.ctx))  # 2-D image positions
        from llama_cpp import llama_cpp as L

        self.n_embd = int(L.llama_model_n_embd_inp(model))  # what mtmd checked it against
        self.encoded = 0  # chunks encoded since load (a cache hit does not count)
        self._cache: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._cache_bytes = 0
        self._cache_limit = cache_bytes(num_ctx, self.n_embd) if num_ctx else CACHE_BYTES
        # Around each native call of the media thread (a decode, the tokenize, an
        # encode), read by the runner's watchdog as the engine's step is.
        self.watch = StepWatch(first_grace=False)
        self._failure: CorralError | None = None  # the runner's (fail), once it has one
        self._lock = threading.Lock()
        self._current: Prepare | None = None  # the request on the media thread
        self._queue: queue.Queue[Prepare | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="vision", daemon=True)
        self._thread.start()

    def prepare(self, text: str, images: list[bytes], add_special: bool, limit: int = 0,
                cancelled: threading.Event | None = None
                ) -> tuple[list[int], list[ImageSpan]]:
        """Tokens and spans for `text`, whose media markers stand for `images` (pictures
        and audio clips, in order). A prompt of `limit` tokens or more is refused once it
        is tokenized, before any of its media is encoded (media cannot be cut to fit);
        `cancelled` stops the encoding between two of its chunks."""
        if text.count(MARKER) != len(images):
            raise BadRequest(f"the prompt has {text.count(MARKER)} image markers for"
                             f" {len(images)} images")
        if self._failure is not None:
            raise self._failure
        request = Prepare(text, images, add_special, limit, cancelled or threading.Event())
        self._queue.put(request)
        if self._failure is not None:  # failed while this was put: fail() may have missed it
            raise self._failure
        try:
            result = request.reply.get(timeout=PREPARE_TIMEOUT)
        except queue.Empty:
            raise RunnerError(f"preparing the prompt's media took over {PREPARE_TIMEOUT:g} s")
        if isinstance(result, CorralError):
            raise result
        return result

    def fail(self, error: CorralError) -> None:
        """Answer `error` to every request waiting here, the one on the media thread
        included (stuck in native code, it may never answer): the runner has failed.
        Requests that come later get it too."""
        self._failure = error
        with self._lock:
            current = self._current
        if current is not None:
            current.reply.put(error)
        closing = False
        while True:
            try:
                waiting = self._queue.get_nowait()
            except queue.Empty:
                break
            if waiting is None:
                closing = True
            else:
                waiting.reply.put(error)
        if closing:  # close() asked first: the thread must still hear it
            self._queue.put(None)

    def close(self) -> None:
        self._queue.put(None)
        # A thread stuck in native code (a stall) is not waited for: the process exits.
        self._thread.join(timeout=0 if self.watch.running_for() else 30)
        if not self._thread.is_alive():
            self._free()

    def alive(self) -> bool:
        return self._thread.is_alive()

    # ---- the vision thread ---------------------------------------------------------------

    def _run(self) -> None:
        while True:
            request = self._queue.get()
            if request is None:
                return
            with self._lock:
                self._current = request
            try:
                request.reply.put(self._prepare(request))
            except CorralError as exc:
                request.reply.put(exc)
            except Exception as exc:  # a bug here must not leave a client hanging
                log.exception("preparing images failed")
                request.reply.put(RunnerError(f"preparing images failed: {exc}"))
            finally:
                with self._lock:
                    self._current = None

    @contextlib.contextmanager
    def _native(self, what: str) -> Iterator[None]:
        self.watch.enter(what)
        try:
            yield
        finally:
            self.watch.leave()

    def _prepare(self, request: Prepare) -> tuple[list[int], list[ImageSpan]]:
        M = self._m
        bitmaps: list[Any] = []
        chunks = M.mtmd_input_chunks_init()
        try:
            for i, data in enumerate(request.images):  # freed below, whichever one fails
                bitmaps.append(self._bitmap(data, i))
            raw = request.text.encode("utf-8", "surrogatepass")
            text = M.mtmd_input_text()
            text.text, text.text_len = raw, len(raw)
            text.add_special, text.parse_special = request.add_special, True
            handles = (M.mtmd_bitmap_p_ctypes * max(len(bitmaps), 1))(*bitmaps)
            with self._native("tokenizing a prompt with media"):
                rc = M.mtmd_tokenize(self.ctx, chunks, ctypes.byref(text), handles,
                                     len(bitmaps))
            if rc != 0:
                raise BadRequest(f"the prompt and its images could not be tokenized ({rc})")
            self._fits(chunks, request.limit)
            return self._collect(chunks, request)
        finally:
            M.mtmd_input_chunks_free(chunks)
            for bitmap in bitmaps:
                M.mtmd_bitmap_free(bitmap)

    def _bitmap(self, data: bytes, index: int) -> Any:
        """The decoded media, named by its place in the request (mtmd gives each of its
        chunks that name). A clip goes through mtmd's helper (miniaudio, which returns
        nothing for bytes it cannot decode); an image is decoded here by the helper's own
        stb_image (exported by libmtmd), since the helper hands an image stb_image cannot
        read on to a video path that starts ffprobe on untrusted bytes."""
        M = self._m
        audio = audio_format(data) is not None
        if audio and not self.audio:
            raise BadRequest("this model does not support audio")
        if not audio and not self.vision:
            raise BadRequest("this model does not support images")
        buf = (ctypes.c_ubyte * len(data)).from_buffer_copy(data)
        with self._native(f"decoding {'audio' if audio else 'image'} {index}"):
            if audio:
                bitmap = M.mtmd_helper_bitmap_init_from_buf(self.ctx, buf, len(data), False)
            else:
                bitmap = _webp_bitmap(M, data) if webp(data) else \
                    _stb_bitmap(M, buf, len(data)) if stb_image(data) else None
        if not bitmap:
            what, kinds = ("audio", "an audio file") if audio else \
                ("image", "a PNG, JPEG, GIF, BMP or WebP")
            raise BadRequest(f"{what} {index} could not be decoded: it is truncated, corrupt"
                             f" or not {kinds}")
        M.mtmd_bitmap_set_id(bitmap, str(index).encode())
        return bitmap

    def _fits(self, chunks: Any, limit: int) -> None:
        """The prompt's tokens, its media's counted as mtmd chunked them, under `limit`."""
        M = self._m
        n = sum(int(M.mtmd_input_chunk_get_n_tokens(M.mtmd_input_chunks_get(chunks, i)))
                for i in range(M.mtmd_input_chunks_size(chunks)))
        if limit and n >= limit:
            raise ContextOverflow(f"the input with its images and audio ({n} tokens) exceeds "
                                  f"the context length ({limit})")

    def _collect(self, chunks: Any, request: Prepare) -> tuple[list[int], list[ImageSpan]]:
        M = self._m
        media = request.images
        tokens: list[int] = []
        spans: list[ImageSpan] = []
        parts: dict[int, int] = {}  # chunks so far of each media item: tiles, audio windows
        for i in range(M.mtmd_input_chunks_size(chunks)):
            chunk = M.mtmd_input_chunks_get(chunks, i)
            kind = M.mtmd_input_chunk_get_type(chunk)
            if kind == _TEXT:
                n = ctypes.c_size_t()
                ids = M.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                tokens.extend(int(ids[k]) for k in range(n.value))
            elif kind in (_IMAGE, _AUDIO):
                if request.cancelled.is_set():  # the client left: the rest is not encoded
                    raise Cancelled("the request was cancelled while its media were encoded")
                index = int(M.mtmd_input_chunk_get_id(chunk).decode())
                part = parts[index] = parts.get(index, -1) + 1
                digest = hashlib.sha256(media[index] + part.to_bytes(4, "big")).digest()
                embd = self._embeddings(chunk, digest)
                key = placeholder(digest)
                non_causal = bool(M.mtmd_decode_use_non_causal(self.ctx, chunk))
                n_pos, grid = self._positions(chunk, kind, embd.shape[0])
                spans.append(ImageSpan(len(tokens), key, embd, non_causal, n_pos, grid))
                tokens.extend([key] * embd.shape[0])
            else:
                raise BadRequest("only images and audio are supported as media")
        return tokens, spans

    def _positions(self, chunk: Any, kind: int, n_tokens: int
                   ) -> tuple[int, tuple[int, int] | None]:
        """(positions the chunk takes, its M-RoPE grid): an M-RoPE image's tokens take
        the positions of a grid of columns x rows (the engine lays them out as
        mtmd_image_tokens_get_decoder_pos does, and checks here that mtmd counts the
        same); anything else one position a token."""
        M = self._m
        n_pos = int(M.mtmd_input_chunk_get_n_pos(chunk))
        if not (self.mrope and kind == _IMAGE):
            if n_pos != n_tokens:
                raise RunnerError(f"the projector's media take {n_pos} positions for"
                                  f" {n_tokens} tokens, a layout this engine does not know")
            return 0, None
        image = M.mtmd_input_chunk_get_tokens_image(chunk)
        columns, rows = int(M.mtmd_image_tokens_get_nx(image)), int(
            M.mtmd_image_tokens_get_ny(image))
        if columns * rows != n_tokens or n_pos != max(columns, rows):
            raise RunnerError(f"the projector's images take {n_pos} positions for"
                              f" {columns} x {rows} tokens, a layout this engine does not know")
        return n_pos, (columns, rows)

    def _embeddings(self, chunk: Any, digest: bytes) -> np.ndarray:
        cached = self._cache.get(digest)
        if cached is not None:
            self._cache.move_to_end(digest)
            return cached
        import numpy as np  # here, at the first image: importing this module stays cheap

        M = self._m
        n_tokens = int(M.mtmd_input_chunk_get_n_tokens(chunk))
        with self._native("one media encode"):
            if M.mtmd_encode_chunk(self.ctx, chunk) != 0:
                raise RunnerError("the projector could not encode the image or audio")
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
