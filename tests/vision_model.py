"""Test helpers for vision: a tiny projector GGUF and images, written without Pillow.

No small vision model ships on PyPI, so the tests make one: a projector GGUF with
random weights from a fixed seed, shaped to feed one of the starters. Two of
llama.cpp's projector types are written, with the minimum its loader asks for:

- "mlp" (LLaVA 1.5): a ViT, then two linear layers; image tokens attend causally.
  Its output width is the chat starter's 576 (SmolLM2-135M).
- "gemma3": a SigLIP-style ViT, average pooling, RMS norm and one projection; image
  tokens attend to each other both ways (non-causal). Its output is 640 wide
  (gemma3:270m), and llama.cpp wraps it in <start_of_image> ... <end_of_image>.

The answers it produces are meaningless; the pipeline that produces them is real.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path
from typing import Callable

import gguf
import numpy as np

IMAGE_SIZE = 32  # pixels a side, what the projector resizes every image to
PATCH = 8  # 4 x 4 patches: 16 image tokens for "mlp"
GEMMA_PATCH = 4  # 8 x 8 patches, pooled 2 x 2: 16 image tokens for "gemma3"
N_EMBD, N_FF, N_HEAD, N_LAYER = 64, 96, 4, 3


def write_projector(path: Path, kind: str = "mlp", text_embd: int = 576, seed: int = 0,
                    image_size: int = IMAGE_SIZE, leave_out: tuple[str, ...] = ()) -> Path:
    """A loadable projector of `kind` ("mlp" or "gemma3") whose output is `text_embd` wide;
    `leave_out` names tensors to omit, for one that must fail to load."""
    rng = np.random.default_rng(seed)
    patch = PATCH if kind == "mlp" else GEMMA_PATCH
    n_pos = (image_size // patch) ** 2

    def rand(*shape: int, std: float = 0.1) -> np.ndarray:
        return rng.normal(0.0, std, shape).astype(np.float32)

    w = gguf.GGUFWriter(str(path), "clip")

    def add(name: str, data: np.ndarray) -> None:
        if name not in leave_out:
            w.add_tensor(name, data)
    w.add_string("general.name", f"corral test projector ({kind})")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_string("clip.projector_type", kind)
    w.add_bool("clip.use_gelu", True)
    w.add_uint32("clip.vision.embedding_length", N_EMBD)
    w.add_uint32("clip.vision.feed_forward_length", N_FF)
    w.add_uint32("clip.vision.block_count", N_LAYER)
    w.add_uint32("clip.vision.projection_dim", text_embd)
    w.add_uint32("clip.vision.attention.head_count", N_HEAD)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    w.add_uint32("clip.vision.image_size", image_size)
    w.add_uint32("clip.vision.patch_size", patch)
    w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    # numpy shapes are ggml's reversed: a [n_in, n_out] matrix is (n_out, n_in) here.
    add("v.patch_embd.weight", rand(N_EMBD, 3, patch, patch, std=0.5))
    add("v.patch_embd.bias", rand(N_EMBD))
    add("v.position_embd.weight", rand(n_pos, N_EMBD, std=0.5))
    add_blocks(add, rand, "v", N_LAYER, N_EMBD, N_FF)
    if kind == "mlp":
        add("mm.0.weight", rand(text_embd, N_EMBD))
        add("mm.0.bias", rand(text_embd))
        add("mm.2.weight", rand(text_embd, text_embd, std=0.05))
        add("mm.2.bias", rand(text_embd))
    elif kind == "gemma3":
        w.add_uint32("clip.vision.projector.scale_factor", 2)
        add("v.post_ln.weight", 1.0 + rand(N_EMBD))
        add("v.post_ln.bias", rand(N_EMBD))
        add("mm.soft_emb_norm.weight", 1.0 + rand(N_EMBD))
        add("mm.input_projection.weight", rand(N_EMBD, text_embd, std=0.5))
    else:
        raise ValueError(kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def add_blocks(add: Callable[[str, np.ndarray], None], rand: Callable[..., np.ndarray],
               prefix: str, n_layer: int, n_embd: int, n_ff: int, k_bias: bool = True) -> None:
    """An encoder's pre-norm transformer blocks, as clip.cpp's build_vit reads them under
    `prefix` ("v" for vision, "a" for audio); `k_bias` False for Whisper's k projection,
    which has none (its graph asserts so)."""
    for il in range(n_layer):
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            add(f"{prefix}.blk.{il}.{name}.weight", rand(n_embd, n_embd))
            if k_bias or name != "attn_k":
                add(f"{prefix}.blk.{il}.{name}.bias", rand(n_embd))
        for name in ("ln1", "ln2"):
            add(f"{prefix}.blk.{il}.{name}.weight", 1.0 + rand(n_embd))
            add(f"{prefix}.blk.{il}.{name}.bias", rand(n_embd))
        add(f"{prefix}.blk.{il}.ffn_up.weight", rand(n_ff, n_embd))
        add(f"{prefix}.blk.{il}.ffn_up.bias", rand(n_ff))
        add(f"{prefix}.blk.{il}.ffn_down.weight", rand(n_embd, n_ff))
        add(f"{prefix}.blk.{il}.ffn_down.bias", rand(n_embd))


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(
        ">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def png_bytes(width: int, height: int, seed: int = 0, color: tuple[int, int, int] | None = None
              ) -> bytes:
    """An RGB PNG: random pixels from `seed`, or one flat `color`."""
    if color is not None:
        pixels = np.empty((height, width, 3), np.uint8)
        pixels[:] = color
    else:
        pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), np.uint8)
    raw = b"".join(b"\x00" + pixels[y].tobytes() for y in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(raw))
            + _chunk(b"IEND", b""))


def png_bomb(side: int = 30000) -> bytes:
    """A few kilobytes that claim `side` x `side` pixels: one zero row, compressed, repeated."""
    row = b"\x00" * (1 + side)  # filter byte + one grey byte a pixel
    comp = zlib.compressobj(9)
    data = b"".join(comp.compress(row) for _ in range(side)) + comp.flush()
    header = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", data)
            + _chunk(b"IEND", b""))


def bmp_bytes(width: int, height: int, seed: int = 0) -> bytes:
    """A 24-bit BMP, bottom-up rows padded to four bytes."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), np.uint8)
    pad = (4 - (width * 3) % 4) % 4
    rows = b"".join(pixels[y].tobytes() + b"\x00" * pad for y in reversed(range(height)))
    header = struct.pack("<IiiHHIIiiII", 40, width, height, 1, 24, 0, len(rows), 2835, 2835, 0, 0)
    return b"BM" + struct.pack("<IHHI", 14 + 40 + len(rows), 0, 0, 54) + header + rows


def webp_bytes(width: int, height: int, seed: int = 0, lossless: bool = True) -> bytes:
    """The pixels of png_bytes(width, height, seed) as a WebP (lossless: the same pixels)."""
    import io

    from PIL import Image

    out = io.BytesIO()
    with Image.open(io.BytesIO(png_bytes(width, height, seed))) as image:
        image.save(out, format="WEBP", lossless=lossless)
    return out.getvalue()


def corrupt_webp() -> bytes:
    """A lossless WebP whose header is whole and whose image data is not."""
    good = webp_bytes(40, 30, seed=4)
    return good[:26] + (b"\xff\x00" * len(good))[:len(good) - 26]
