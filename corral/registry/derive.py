"""Steps of a create that make or check weight layers: quantizing the model, checking
LoRA adapters against it.

Quantizing itself runs llama.cpp, which the registry does not load: the server passes
a `Quantizer` (a child process) in. Its output goes to a temporary file in the store
and becomes a blob only when it is complete and parses as a GGUF; any failure leaves
nothing behind.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Protocol

from corral.errors import BadRequest, CorralError, InvalidModelFile, ModelfileError, NoSpace
from corral.registry import manifest as mt
from corral.registry.gguf import GGUFInfo, inspect_gguf
from corral.registry.manifest import Layer
from corral.registry.progress import Progress
from corral.registry.store import Store

# What `create --quantize` accepts (case-insensitive), as llama_ftype values.
TYPES = {"q4_0": 2, "q4_1": 3, "q8_0": 7, "q5_0": 8, "q5_1": 9, "q3_k_s": 11, "q3_k_m": 12,
         "q3_k_l": 13, "q4_k_s": 14, "q4_k_m": 15, "q5_k_s": 16, "q5_k_m": 17, "q6_k": 18,
         "f16": 1, "bf16": 32}
FLOAT_SOURCES = {"F32", "F16", "BF16"}
PLACEHOLDER_DIGEST = "0" * 19  # what Ollama's quantize progress carries as its digest


def file_type(name: str) -> int:
    """The llama_ftype for a type name; a 400 naming the accepted ones otherwise."""
    ftype = TYPES.get(name.lower()) if isinstance(name, str) else None
    if ftype is None:
        accepted = ", ".join(k.upper() for k in TYPES)
        raise BadRequest(f"unsupported quantization type {name!r}; use one of {accepted}")
    return ftype


class Quantizer(Protocol):
    def __call__(self, src: Path, dst: Path, type_name: str, requantize: bool,
                 progress: Callable[[int, int, str], None]) -> None: ...


def quantize_layer(store: Store, model: Layer, type_name: str, requantize: bool,
                   quantizer: Quantizer | None, progress: Progress) -> Layer:
    """The model layer `model` quantized to `type_name`, stored as a new blob."""
    if quantizer is None:
        raise ModelfileError("quantization is not available in this process")
    info = store.gguf_info(model.digest)
    source, target = info.quantization.upper(), type_name.upper()
    if source not in FLOAT_SOURCES:
        if not requantize:
            raise ModelfileError("quantization is only supported for F16, BF16 and F32 models"
                                 f" (this one is {source}; set requantize to do it anyway)")
        progress({"status": f"warning: requantizing a {source} model to {target} "
                            "loses more quality than quantizing its F16 source"})
    _check_space(store, model.size)
    status = f"quantizing {source} model to {target}"
    tmp = store.temp_path()
    total = sum(info.tensor_bytes.values())  # progress counts the source's tensor bytes
    done: dict[str, int] = {"bytes": 0}

    def tensor_done(index: int, count: int, name: str) -> None:
        done["bytes"] += info.tensor_bytes.get(name, 0)
        progress({"status": status, "digest": PLACEHOLDER_DIGEST, "total": total,
                  "completed": min(done["bytes"], total)})

    try:
        quantizer(store.blob_path(model.digest), tmp, type_name, requantize, tensor_done)
        progress({"status": "verifying conversion"})
        try:
            inspect_gguf(tmp)
        except InvalidModelFile:
            raise CorralError("quantizing produced an invalid model file") from None
        digest, size = store.adopt(tmp)
    finally:
        tmp.unlink(missing_ok=True)
    progress({"status": f"creating new layer {digest}"})
    return Layer(mt.MODEL, digest, size)


def _check_space(store: Store, source_size: int) -> None:
    # No output is larger than its F32 source; an F16 or quantized source at most doubles
    # (to F32 is not offered). Failing now beats llama.cpp failing half-way.
    free = store.free_space()
    if free < source_size + (64 << 20):
        raise NoSpace(f"no space left on device: quantizing needs about "
                      f"{source_size / 1e9:.1f} GB free, {free / 1e9:.1f} GB is")


def check_adapter(base: GGUFInfo, adapter: GGUFInfo) -> None:
    """Refuse a LoRA that llama.cpp would reject, or that belongs to another model."""
    kind = adapter.metadata.get("general.type")
    if kind != "adapter" or adapter.metadata.get("adapter.type") != "lora":
        raise ModelfileError("the adapter is not a LoRA adapter GGUF "
                             "(general.type must be 'adapter', adapter.type 'lora')")
    if adapter.architecture != base.architecture:
        raise ModelfileError(f"the adapter is for {adapter.architecture}, "
                             f"the model is {base.architecture}")
    for name in adapter.tensor_shapes:
        for suffix in (".lora_a", ".lora_b"):
            if name.endswith(suffix):
                target = name[:-len(suffix)]
                if target == "token_embd.weight":
                    continue  # stored with A and B swapped; llama.cpp checks it itself
                if target not in base.tensor_shapes:
                    raise ModelfileError(f"the adapter changes {target}, "
                                         "which the model does not have")
                _check_shapes(target, base.tensor_shapes[target], adapter, suffix)


def _check_shapes(target: str, base_shape: tuple[int, ...], adapter: GGUFInfo,
                  suffix: str) -> None:
    # ggml shapes: lora_a is [n_in, rank], lora_b is [rank, n_out]; the base is [n_in, n_out].
    shape = adapter.tensor_shapes[target + suffix]
    other = adapter.tensor_shapes.get(target + (".lora_b" if suffix == ".lora_a" else ".lora_a"))
    want = base_shape[0] if suffix == ".lora_a" else base_shape[1]
    got = shape[0] if suffix == ".lora_a" else shape[1]
    rank_ok = other is not None and len(other) == 2 and len(shape) == 2 and (
        shape[1] == other[0] if suffix == ".lora_a" else shape[0] == other[1])
    if len(shape) != 2 or len(base_shape) < 2 or got != want or not rank_ok:
        raise ModelfileError(f"the adapter's {target}{suffix} has shape {list(shape)}, "
                             f"which does not fit the model's {list(base_shape)}")
