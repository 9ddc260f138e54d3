"""Memory estimates for a load: weights per layer, KV per token, compute buffer.

They decide how many layers go to the GPU (the rest run on the CPU) and how
many slots fit. Pure functions of GGUF metadata, so they are unit-tested
without a GPU.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, replace

from corral.registry.gguf import GGUFInfo
from corral.runner.layerkinds import LayerKinds, layer_kinds, snapshot_planes
from corral.runner.loadconfig import DEFAULT_BATCH

KV_BYTES_PER_ELEMENT = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}
COMPUTE_FIXED = 64 << 20  # graph scratch beyond the logits buffer


@dataclass(frozen=True)
class Estimate:
    layers: int
    gpu_layers: int
    weights: int  # bytes, all layers plus embeddings/output
    kv: int  # bytes for every slot's context
    compute: int
    gpu_bytes: int
    cpu_bytes: int
    checkpoints: int = 0  # the most the slots keep of their windows or states (host RAM)
    snapshots: int = 0  # of `kv`, a recurrent memory's states kept for taking back drafts

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.compute + self.checkpoints

    def without(self, extra: int) -> "Estimate":
        """This estimate less `extra` bytes it counted beside the weights (a draft model
        that did not load), on the side it counted them: `estimate` puts what is beside
        the layers on the GPU when every layer is there, else on the CPU."""
        on_gpu = self.gpu_layers == self.layers > 0
        return replace(self, weights=self.weights - extra,
                       gpu_bytes=max(self.gpu_bytes - extra, 0) if on_gpu else self.gpu_bytes,
                       cpu_bytes=self.cpu_bytes if on_gpu else max(self.cpu_bytes - extra, 0))


# Sequences' worth of cells a draft model's context holds (runner.speculative.draftmodel).
DRAFT_STREAMS = 4
# The most the n-gram index of speculative decoding holds (runner.speculative.ngram: its
# LIMIT keys at KEY_BYTES and TOKENS tokens at TOKEN_BYTES; a test holds the two equal).
NGRAM_INDEX_BYTES = (1 << 18) * 100 + (1 << 21) * 40


def draft_bytes(info: GGUFInfo, file_size: int, num_ctx: int, n_slots: int,
                kv_type: str = "f16") -> int:
    """What a draft model loaded beside a model holds: its weights, and the KV of its
    cells (`num_ctx` tokens for each of up to DRAFT_STREAMS sequences). An MTP sidecar's
    head holds one layer's KV a position of every slot's context."""
    if is_mtp_sidecar(info):
        return file_size + head_kv_bytes(info, num_ctx, n_slots, kv_type)
    cells = num_ctx * min(n_slots, DRAFT_STREAMS)
    return file_size + cells * kv_bytes_per_token(info, kv_type)


def head_kv_bytes(info: GGUFInfo, num_ctx: int, n_slots: int, kv_type: str = "f16"
                  ) -> int:
    """The KV of an MTP head (runner.llama.mtpcontext): one layer's, a position of every
    slot's context. 0 for a model without one, or with several (not run)."""
    last = (info.block_count or 0) - 1
    if not _head_at(info, last) or _head_at(info, last - 1):
        return 0
    return num_ctx * n_slots * kv_bytes_per_token(info, kv_type) // max(last + 1, 1)


def is_mtp_sidecar(info: GGUFInfo) -> bool:
    """A GGUF that holds an MTP head and no model (as llama.cpp tells them: a `nextn`
    block last, and no first block), which drafts for a model of its family."""
    return _head_at(info, (info.block_count or 0) - 1) and \
        "blk.0.attn_norm.weight" not in info.tensor_bytes


def _head_at(info: GGUFInfo, block: int) -> bool:
    """Whether block `block` is an MTP head (its `nextn` projection is there)."""
    return f"blk.{block}.nextn.eh_proj.weight" in info.tensor_bytes


# Sliding-window models by architecture: of every this many layers all but one attend
# within the window (llama.cpp's load_swa_pattern defaults, src/models/).
SWA_PATTERN = {"gemma2": 2, "gemma3": 6, "gemma3n": 5, "cohere2": 4, "gpt-oss": 2,
               "exaone4": 4, "olmo2": 4}
# A sliding-window model's cache holds only the window where the context is at least this
# many windows (runner.llama.context), and its slots keep at most CHECKPOINTS of it.
WINDOWS_FOR_WINDOW_CACHE = 4
CHECKPOINTS = 8


def window_layers(info: GGUFInfo, num_ctx: int, window_cache: bool) -> int:
    """How many layers keep only the window's KV, in a context of `num_ctx` a sequence
    where a window cache may be made (`window_cache`: not under CORRAL_DETERMINISTIC);
    0 where none is."""
    window, pattern = info.sliding_window or 0, SWA_PATTERN.get(info.architecture)
    if not (window_cache and window and pattern) or num_ctx < WINDOWS_FOR_WINDOW_CACHE * window:
        return 0
    layers = info.block_count or 0
    return layers - layers // pattern


def kv_bytes(info: GGUFInfo, num_ctx: int, n_slots: int, kv_type: str = "f16",
             n_batch: int = DEFAULT_BATCH, window_cache: bool = False) -> tuple[int, int]:
    """The KV of `n_slots` sequences of `num_ctx` tokens, and the most their checkpoints
    hold: every layer's KV for every token, but in a window cache the sliding-window
    layers' for each sequence's window and a batch (as llama.cpp sizes it), and a slot's
    checkpoints a window each, as many as the KV saved pays for."""
    layers = info.block_count or 0
    per_layer = kv_bytes_per_token(info, kv_type) // max(layers, 1)
    cells, swa = num_ctx * n_slots, window_layers(info, num_ctx, window_cache)
    if not swa:
        return per_layer * layers * cells, 0
    window = info.sliding_window or 0
    held = min(cells, window * (n_slots + 1) + n_batch)
    kept = min(CHECKPOINTS, num_ctx // window - 1) * n_slots * window
    return per_layer * ((layers - swa) * cells + swa * held), per_layer * swa * kept


def hybrid_bytes(info: GGUFInfo, kinds: LayerKinds, num_ctx: int, n_slots: int,
                 weights: int, kv_type: str = "f16", speculative: bool = True
                 ) -> tuple[int, int, int]:
    """A hybrid's or recurrent model's memory as llama.cpp sizes it, the most its slots'
    checkpoints hold, and of the first the copies of states kept for taking back drafts:
    its attention layers' KV for every token, a recurrent state for every slot and the
    scratch sequence with those copies (n_rs_seq, made only where speculation is on),
    and each slot's checkpoints, each a state (runner.llama.context)."""
    seqs = n_slots + 1
    planes = kinds.state * seqs * snapshot_planes(kinds.state, seqs, weights) \
        if speculative else 0
    kept = snapshot_planes(kinds.state, n_slots, weights, CHECKPOINTS)
    return (kv_per_token(info, kv_type) * num_ctx * n_slots + kinds.state * seqs + planes,
            kinds.state * n_slots * kept, planes)


def kv_per_token(info: GGUFInfo, kv_type: str = "f16") -> int:
    """The KV a token takes in the layers that keep KV: a hybrid's attention layers
    (runner.layerkinds), a transformer's every layer."""
    kinds = layer_kinds(info)
    if kinds is None:
        return kv_bytes_per_token(info, kv_type)
    return kv_bytes_per_token(info, kv_type) // max(info.block_count or 1, 1) * kinds.attention


def kv_bytes_per_token(info: GGUFInfo, kv_type: str = "f16") -> int:
    layers = info.block_count or 0
    heads_kv = info.head_count_kv or info.head_count or 0
    head_dim = (info.embedding_length or 0) // max(info.head_count or 1, 1)
    k = info.key_length or head_dim
    # Multi-head latent attention (DeepSeek-2/3, Kimi, BailingMoE3: key_length_mla said)
    # caches the latent K alone, key_length a KV head, and no V (llama_kv_cache: has_v).
    mla = info.metadata.get(f"{info.architecture}.attention.key_length_mla")
    v = 0 if isinstance(mla, int) and mla else info.value_length or head_dim
    per_element = KV_BYTES_PER_ELEMENT.get(kv_type, 2.0)
    return int(layers * heads_kv * (k + v) * per_element)


def compute_bytes(info: GGUFInfo, n_batch: int, n_vocab: int, n_slots: int) -> int:
    # Logits for every slot's sampled row, plus activations of one batch.
    embd = info.embedding_length or 0
    return COMPUTE_FIXED + 4 * n_vocab * max(n_slots, 1) + 16 * n_batch * embd


def estimate(info: GGUFInfo, num_ctx: int, n_slots: int, free_vram: int, num_gpu: int = -1,
             kv_type: str = "f16", n_batch: int = DEFAULT_BATCH, n_vocab: int = 32000,
             adapters: int = 0, window_cache: bool = False, speculative: bool = True
             ) -> Estimate:
    """Split layers between GPU and CPU; `num_gpu` >= 0 overrides the fit.

    `adapters` is the LoRA adapters' bytes, held beside the weights they change;
    `window_cache`: a sliding-window model may keep only the window's KV (`kv_bytes`);
    `speculative`: a recurrent memory keeps copies of its states for drafts."""
    per_layer = info.layer_bytes()
    layers = info.block_count or len(per_layer)
    weights = sum(info.tensor_bytes.values()) + adapters
    other = weights - sum(per_layer.values())  # embeddings, output head, norms
    kinds, snapshots = layer_kinds(info), 0
    if kinds is None:
        kv, checkpoints = kv_bytes(info, num_ctx, n_slots, kv_type, n_batch, window_cache)
    else:  # the share of the weights is the model's own, as the runtime's
        kv, checkpoints, snapshots = hybrid_bytes(info, kinds, num_ctx, n_slots,
                                                  weights - adapters, kv_type, speculative)
    kv_layer = kv // max(layers, 1)
    compute = compute_bytes(info, n_batch, n_vocab, n_slots)
    if num_gpu >= 0:
        gpu_layers = min(num_gpu, layers)
    elif free_vram <= 0:
        gpu_layers = 0
    else:
        budget = free_vram - compute - other
        gpu_layers = 0
        for i in range(layers):
            need = per_layer.get(i, 0) + kv_layer
            if budget < need:
                break
            budget -= need
            gpu_layers += 1
    gpu = sum(per_layer.get(i, 0) + kv_layer for i in range(layers - gpu_layers, layers))
    if gpu_layers == layers and layers:
        gpu += other + compute
    kv = kv_layer * layers
    return Estimate(layers, gpu_layers, weights, kv, compute, gpu,
                    weights + kv + compute + checkpoints - gpu, checkpoints,
                    snapshots if kinds is not None else 0)


CPU_MAX_SLOTS = 16  # aggregate decode on a CPU stops growing near 8 streams; 16 keeps the queue off
GPU_MAX_SLOTS = 32  # see docs/gpu.md


CACHE_RAM_MAX = 4 << 30


def prompt_cache_budget(setting: int | None, total_ram: int, free_ram: int = 0) -> int:
    """Host RAM for one model's prompt cache: CORRAL_CACHE_RAM, or an eighth of the
    machine's RAM up to 4 GiB, and at most a quarter of what is free when the model
    loads (the slots' KV comes first). An eighth leaves a laptop of 16 GiB 14 for models
    and everything else, and 2 GiB keeps about 90 conversations of 1,200 tokens warm on
    a 270M model or 16 on a 1B one (llama-server keeps 8 GiB by default, sized for a
    server); past 4 GiB a cache mostly keeps prompts nobody sends again."""
    if setting is not None:
        return setting
    budget = min(total_ram // 8, CACHE_RAM_MAX) if total_ram > 0 else 0
    return min(budget, free_ram // 4) if free_ram > 0 else budget


def memory_margin(budget: int) -> int:
    """Memory auto sizing leaves free: a tenth, and at least 512 MiB, for everything else."""
    return max(budget // 10, 512 << 20)


def slots_that_fit(info: GGUFInfo, num_ctx: int, budget: int, max_slots: int,
                   kv_type: str = "f16", n_batch: int = DEFAULT_BATCH,
                   window_cache: bool = False, speculative: bool = True) -> int:
    """The most slots, each with its whole `num_ctx`, whose estimate fits `budget` bytes
    after the margin; at least one (a load that cannot fit fails on its own terms)."""
    room = budget - memory_margin(budget)
    best = 1
    for n in range(2, max(max_slots, 1) + 1):
        if estimate(info, num_ctx, n, 0, kv_type=kv_type, n_batch=n_batch,
                    window_cache=window_cache, speculative=speculative).total > room:
            break
        best = n
    return best


DEFAULT_CTX_MIN = 4096  # the old default, and Ollama's smallest tier
DEFAULT_CTX_MAX = 262144  # Ollama's largest tier
DEFAULT_CTX_STEP = 1024


def context_that_fits(info: GGUFInfo, budget: int, kv_type: str = "f16",
                      n_batch: int = DEFAULT_BATCH, window_cache: bool = False,
                      speculative: bool = True) -> int:
    """The default num_ctx: the model's trained length, up to DEFAULT_CTX_MAX, as far as
    one slot of it fits `budget` bytes after the margin (in steps of DEFAULT_CTX_STEP);
    never under DEFAULT_CTX_MIN (or the trained length, where that is shorter). An
    agent's first request is 10-20k tokens, so a model that has the length and the
    memory gets 32k and more; memory that follows use (docs/serving.md) makes a long
    context cost only the cells a prompt writes. A window cache (`window_cache`) costs
    a sliding-window model only its other layers' KV past the window."""
    trained = info.context_length or DEFAULT_CTX_MIN
    want = min(trained, DEFAULT_CTX_MAX)
    floor = min(trained, DEFAULT_CTX_MIN)
    if budget <= 0:
        return floor
    room = budget - memory_margin(budget)

    def fits(num_ctx: int) -> bool:
        return estimate(info, num_ctx, 1, 0, kv_type=kv_type, n_batch=n_batch,
                        window_cache=window_cache, speculative=speculative).total <= room

    if fits(want):
        return want
    steps = range(DEFAULT_CTX_STEP, want, DEFAULT_CTX_STEP)
    return max([floor] + [n for n in steps if fits(n)])


def pool_tokens_that_fit(info: GGUFInfo, want: int, budget: int, n_seqs: int,
                         kv_type: str = "f16", n_batch: int = DEFAULT_BATCH) -> int:
    """A shared KV pool of up to `want` tokens that fits `budget` after the margin."""
    room = budget - memory_margin(budget)
    fixed = estimate(info, 0, n_seqs, 0, kv_type=kv_type, n_batch=n_batch).total
    per_token = max(kv_per_token(info, kv_type), 1)
    return max(256, min(want, (room - fixed) // per_token))


def free_gpu_memory() -> int:
    """Free bytes summed over GPU devices that ggml reports; 0 on a CPU-only build."""
    if not gpu_backend_present():
        return 0  # without importing llama_cpp: the daemon's first load waits for this
    return _ggml_free()


def _ggml_free() -> int:
    try:
        import llama_cpp as L

        lib = L.llama_cpp._lib
        lib.ggml_backend_dev_count.restype = ctypes.c_size_t
        lib.ggml_backend_dev_get.restype = ctypes.c_void_p
        lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
        lib.ggml_backend_dev_type.restype = ctypes.c_int
        lib.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
        lib.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                                                ctypes.POINTER(ctypes.c_size_t)]
    except (ImportError, AttributeError):
        return 0
    total_free = 0
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        if lib.ggml_backend_dev_type(dev) not in (1, 2):  # GPU, IGPU
            continue
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        total_free += free.value
    return total_free


def daemon_free_gpu_memory() -> int:
    """Free VRAM as the daemon asks for it: from NVML where there is a CUDA build and a
    driver (no CUDA context, so no VRAM held by the daemon itself), else from ggml."""
    names = _library_names()
    if not gpu_backend_present(names):
        return 0
    from corral.runner import nvml

    free = nvml.free_bytes() if _has_backend("cuda", names) else None
    return _ggml_free() if free is None else free


_GPU_BACKENDS = ("cuda", "hip", "vulkan", "metal", "sycl", "opencl", "musa", "cann")


def gpu_backend_present(names: list[str] | None = None) -> bool:
    """Whether the installed llama.cpp ships a GPU backend library beside its own (in the
    package, or where LLAMA_CPP_LIB_PATH points llama-cpp-python instead)."""
    names = _library_names() if names is None else names
    return any(_has_backend(b, names) for b in _GPU_BACKENDS)


def _has_backend(backend: str, names: list[str] | None = None) -> bool:
    names = _library_names() if names is None else names
    return any(n.startswith((f"libggml-{backend}", f"ggml-{backend}")) for n in names)


def _library_names() -> list[str]:
    import importlib.util

    from corral.config import llama_lib_path

    spec = importlib.util.find_spec("llama_cpp")
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    libs = [os.path.join(root, "lib") for root in roots] + [p for p in [llama_lib_path()] if p]
    return [n for lib in libs if os.path.isdir(lib) for n in os.listdir(lib)]
