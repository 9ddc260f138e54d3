"""Test helpers for M-RoPE vision: a tiny random Qwen-VL pair (text model + projector).

No small Qwen-VL ships on PyPI, so the tests make one with the `gguf` package: random
weights from a fixed seed, the minimum the pinned llama.cpp asks for, shaped like
Qwen2-VL / Qwen2.5-VL / Qwen3-VL:

- text: arch `qwen2vl` (or `qwen3vl`), 64 wide, 2 layers, head_dim 16. Its RoPE is
  M-RoPE (qwen3vl: interleaved IMRoPE): `rope.dimension_sections` holds 4 ints that add
  up to head_dim / 2, the first three rotated by the t, h and w positions. The
  vocabulary, merges and ChatML template are the chat starter's (SmolLM2), with Qwen's
  vision control tokens appended, so text tokenizes as a real model would.
- projector: "qwen2vl_merger" (LayerNorm ViT, QuickGELU MLP), "qwen2.5vl_merger" (RMS
  norm, SiLU-gated MLP, window attention every layer but the last) or "qwen3vl_merger"
  (fused qkv, patch bias, learned positions, optional deepstack). Patches of PATCH px
  are embedded by two conv kernels (Qwen's temporal patch of 2 frames, split), 2 x 2
  patches are merged into one token, so an image becomes (w / 2P) x (h / 2P) tokens;
  the image is resized (aspect kept, sides rounded to 2P) to hold 8..4096 of them.

The pinned loader reads no RMS-norm epsilon for `qwen2vl` (llama_model_qwen2vl's
load_arch_hparams reads only the rope sections: f_norm_rms_eps is 0, for real Qwen2-VL
GGUFs too); it is written anyway, and harmless here.

mtmd lays an image out on the decoder's M-RoPE grid: nx * ny tokens take only
max(nx, ny) positions (n_pos), token i at (t, x, y) = (p0, p0 + i % nx, p0 + i // nx).
The answers mean nothing; the pipeline that produces them is real.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from benchmarks.gpu_model import field_value
from tests.vision_model import add_blocks

# text model
TEXT_EMBD, TEXT_FF, TEXT_LAYERS, TEXT_HEADS, TEXT_HEADS_KV, HEAD_DIM = 64, 128, 2, 4, 2, 16
# Qwen2-VL's [16, 24, 24, 0] of head_dim 128, scaled to 16: t, h, w, (unused); sum = 8
ROPE_SECTIONS = (2, 3, 3, 0)
# Qwen3-VL's [24, 20, 20, 0], scaled; IMRoPE interleaves them t h w t h w ...
QWEN3_ROPE_SECTIONS = (3, 3, 2, 0)
ATTN_STD = 0.3  # large enough that the context (the image) moves the next token
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")  # Qwen's, appended

# projector
KINDS = ("qwen2vl_merger", "qwen2.5vl_merger", "qwen3vl_merger")
N_EMBD, N_FF, N_HEAD, N_LAYER = 64, 96, 4, 2
MERGE = 2  # spatial merge: 2 x 2 patches a token
PATCH = {"qwen2vl_merger": 14, "qwen2.5vl_merger": 14, "qwen3vl_merger": 16}
QWEN3_POS_SIDE = 4  # the learned position table is 4 x 4, interpolated to the patch grid


def tokens_grid(kind: str, width: int, height: int) -> tuple[int, int]:
    """(nx, ny) tokens of an image whose sides are multiples of 2 * PATCH and whose
    token count is within 8..4096 (mtmd then keeps its size)."""
    side = PATCH[kind] * MERGE
    assert width % side == 0 and height % side == 0
    nx, ny = width // side, height // side
    assert 8 <= nx * ny <= 4096
    return nx, ny


def _copy_vocab(reader: gguf.GGUFReader, w: gguf.GGUFWriter, extra: tuple[str, ...]) -> int:
    """Every `tokenizer.*` field of `reader`, with `extra` appended as control tokens;
    the vocabulary's size."""
    n_vocab = 0
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        value, vtype, sub = field_value(field)
        if name == "tokenizer.ggml.tokens":
            assert isinstance(value, list)
            value = value + list(extra)
            n_vocab = len(value)
        elif name == "tokenizer.ggml.token_type":
            assert isinstance(value, list)
            value = value + [int(gguf.TokenType.CONTROL)] * len(extra)
        elif name == "tokenizer.ggml.scores":
            assert isinstance(value, list)
            value = value + [0.0] * len(extra)
        w.add_key_value(name, value, vtype, sub_type=sub)
    assert n_vocab
    return n_vocab


def _write_text(path: Path, vocab_gguf: Path, arch: str, seed: int, deepstack: int) -> Path:
    path = Path(path)
    reader = gguf.GGUFReader(str(vocab_gguf))
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    n_vocab = _copy_vocab(reader, w, VISION_TOKENS)
    w.add_name(f"corral test {arch}")
    w.add_file_type(1)  # MOSTLY_F16
    w.add_context_length(4096)
    w.add_embedding_length(TEXT_EMBD)
    w.add_block_count(TEXT_LAYERS)
    w.add_feed_forward_length(TEXT_FF)
    w.add_head_count(TEXT_HEADS)
    w.add_head_count_kv(TEXT_HEADS_KV)
    w.add_rope_freq_base(1_000_000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_sections(list(ROPE_SECTIONS if arch == "qwen2vl"
                                       else QWEN3_ROPE_SECTIONS))
    if arch == "qwen3vl":
        w.add_key_length(HEAD_DIM)
        w.add_value_length(HEAD_DIM)
        w.add_num_deepstack_layers(deepstack)

    def rand(*dims: int, std: float = 0.05) -> np.ndarray:  # numpy order: ggml's reversed
        return rng.normal(0.0, std, dims).astype(np.float16 if len(dims) > 1 else np.float32)

    def ones(n: int) -> np.ndarray:
        return (1.0 + rng.normal(0.0, 0.05, n)).astype(np.float32)

    e, q, kv = TEXT_EMBD, TEXT_HEADS * HEAD_DIM, TEXT_HEADS_KV * HEAD_DIM
    w.add_tensor("token_embd.weight", rand(n_vocab, e, std=0.5))
    w.add_tensor("output_norm.weight", ones(e))
    # untied: with the embeddings as the output a random model repeats its last token
    w.add_tensor("output.weight", rand(n_vocab, e, std=0.5))
    for i in range(TEXT_LAYERS):
        tensors: list[tuple[str, np.ndarray]] = [
            ("attn_norm.weight", ones(e)), ("attn_q.weight", rand(q, e, std=ATTN_STD)),
            ("attn_k.weight", rand(kv, e, std=ATTN_STD)),
            ("attn_v.weight", rand(kv, e, std=ATTN_STD)),
            ("attn_output.weight", rand(e, q, std=ATTN_STD)), ("ffn_norm.weight", ones(e)),
            ("ffn_gate.weight", rand(TEXT_FF, e)), ("ffn_up.weight", rand(TEXT_FF, e)),
            ("ffn_down.weight", rand(e, TEXT_FF))]
        if arch == "qwen2vl":  # Qwen2 has q/k/v biases
            tensors += [("attn_q.bias", rand(q)), ("attn_k.bias", rand(kv)),
                        ("attn_v.bias", rand(kv))]
        else:  # Qwen3 has q/k norms instead
            tensors += [("attn_q_norm.weight", ones(HEAD_DIM)),
                        ("attn_k_norm.weight", ones(HEAD_DIM))]
        for name, data in tensors:
            w.add_tensor(f"blk.{i}.{name}", data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_qwen2vl_text(path: Path | str, vocab_gguf: Path, seed: int = 0) -> Path:
    """A loadable `qwen2vl` text model (M-RoPE) on `vocab_gguf`'s vocabulary, 64 wide."""
    return _write_text(Path(path), vocab_gguf, "qwen2vl", seed, 0)


def write_qwen3vl_text(path: Path | str, vocab_gguf: Path, seed: int = 0,
                       deepstack: int = 1) -> Path:
    """A loadable `qwen3vl` text model (IMRoPE); its input embeddings are
    64 * (1 + deepstack) wide: the image's main embedding, then one per deepstack layer
    (added to the output of text layers 0 .. deepstack - 1). Text tokens are zero-padded."""
    return _write_text(Path(path), vocab_gguf, "qwen3vl", seed, deepstack)


def _projector_keys(w: gguf.GGUFWriter, kind: str, text_embd: int, deepstack: int) -> None:
    K = gguf.Keys
    patch = PATCH[kind]
    qwen25, qwen3 = kind == "qwen2.5vl_merger", kind == "qwen3vl_merger"
    w.add_string(K.General.NAME, f"corral test projector ({kind})")
    w.add_bool(K.Clip.HAS_VISION_ENCODER, True)
    w.add_string(K.Clip.PROJECTOR_TYPE, kind)
    w.add_uint32(K.ClipVision.EMBEDDING_LENGTH, N_EMBD)
    w.add_uint32(K.ClipVision.FEED_FORWARD_LENGTH, N_FF)
    w.add_uint32(K.ClipVision.BLOCK_COUNT, N_LAYER)
    w.add_uint32(K.ClipVision.PROJECTION_DIM, text_embd)
    w.add_uint32(K.ClipVision.Attention.HEAD_COUNT, N_HEAD)
    w.add_float32(K.ClipVision.Attention.LAYERNORM_EPS, 1e-6)
    # image_size is only the warmup's (dynamic resolution); Qwen3-VL's is the position
    # table's side in pixels
    w.add_uint32(K.ClipVision.IMAGE_SIZE, QWEN3_POS_SIDE * patch if qwen3 else 560)
    w.add_uint32(K.ClipVision.PATCH_SIZE, patch)
    w.add_uint32(K.ClipVision.SPATIAL_MERGE_SIZE, MERGE)
    w.add_array(K.ClipVision.IMAGE_MEAN, [0.48145466, 0.4578275, 0.40821073])  # CLIP's
    w.add_array(K.ClipVision.IMAGE_STD, [0.26862954, 0.26130258, 0.27577711])
    if qwen25:
        w.add_bool(K.ClipVision.USE_SILU, True)
        # full attention in every 2nd layer (layer 1), 112 px windows in the others
        w.add_uint32(K.ClipVision.N_WA_PATTERN, 2)
    elif qwen3:
        w.add_bool(K.ClipVision.USE_GELU, True)
        if deepstack:
            w.add_array(K.ClipVision.IS_DEEPSTACK_LAYERS,
                        [il < deepstack for il in range(N_LAYER)])
    # else Qwen2-VL: QuickGELU, llama.cpp's default


def write_qwen_vl_projector(path: Path | str, kind: str = "qwen2vl_merger",
                            text_embd: int = TEXT_EMBD, seed: int = 0, deepstack: int = 1,
                            leave_out: tuple[str, ...] = ()) -> Path:
    """A loadable Qwen-VL projector of `kind` whose output is `text_embd` wide
    (qwen3vl_merger: text_embd * (1 + deepstack), to pair with write_qwen3vl_text);
    `leave_out` names tensors to omit, for one that must fail to load."""
    if kind not in KINDS:
        raise ValueError(kind)
    path = Path(path)
    rng = np.random.default_rng(seed)
    patch = PATCH[kind]
    qwen25, qwen3 = kind == "qwen2.5vl_merger", kind == "qwen3vl_merger"

    def rand(*shape: int, std: float = 0.1) -> np.ndarray:
        return rng.normal(0.0, std, shape).astype(np.float32)

    w = gguf.GGUFWriter(str(path), "clip")

    def add(name: str, data: np.ndarray) -> None:
        if name in leave_out:
            return
        if qwen25 and name.endswith(("ln1.bias", "ln2.bias")):
            return  # Qwen2.5-VL's ViT norms are RMS norms, with no bias
        if qwen3 and ".attn_" in name and name.split(".")[3] in ("attn_q", "attn_k", "attn_v"):
            return  # Qwen3-VL's ViT has one fused qkv, added below
        w.add_tensor(name, data)

    _projector_keys(w, kind, text_embd, deepstack)

    # numpy shapes are ggml's reversed: a [n_in, n_out] matrix is (n_out, n_in) here.
    # Qwen's Conv3D patch embedding (2 frames) split into two Conv2D kernels.
    add("v.patch_embd.weight", rand(N_EMBD, 3, patch, patch, std=0.05))
    add("v.patch_embd.weight.1", rand(N_EMBD, 3, patch, patch, std=0.05))
    if qwen3:
        add("v.patch_embd.bias", rand(N_EMBD))
        add("v.position_embd.weight", rand(QWEN3_POS_SIDE ** 2, N_EMBD, std=0.5))
    add_blocks(add, rand, "v", N_LAYER, N_EMBD, N_FF)
    for il in range(N_LAYER):
        if qwen25:  # gated: down(silu(gate(x)) * up(x))
            add(f"v.blk.{il}.ffn_gate.weight", rand(N_FF, N_EMBD))
            add(f"v.blk.{il}.ffn_gate.bias", rand(N_FF))
        if qwen3:
            add(f"v.blk.{il}.attn_qkv.weight", rand(3 * N_EMBD, N_EMBD))
            add(f"v.blk.{il}.attn_qkv.bias", rand(3 * N_EMBD))
    # the merger: a norm per patch (v.post_ln), then 2 x 2 patches -> MLP
    add("v.post_ln.weight", 1.0 + rand(N_EMBD))
    if not qwen25:
        add("v.post_ln.bias", rand(N_EMBD))
    merged = N_EMBD * MERGE * MERGE
    add("mm.0.weight", rand(merged, merged, std=0.05))
    add("mm.0.bias", rand(merged))
    add("mm.2.weight", rand(text_embd, merged, std=0.05))
    add("mm.2.bias", rand(text_embd))
    if qwen3:  # deepstack mergers: norm over the merged 4 patches, then an MLP
        for il in range(deepstack):
            add(f"v.deepstack.{il}.norm.weight", 1.0 + rand(merged))
            add(f"v.deepstack.{il}.norm.bias", rand(merged))
            add(f"v.deepstack.{il}.fc1.weight", rand(merged, merged, std=0.05))
            add(f"v.deepstack.{il}.fc1.bias", rand(merged))
            add(f"v.deepstack.{il}.fc2.weight", rand(text_embd, merged, std=0.05))
            add(f"v.deepstack.{il}.fc2.bias", rand(text_embd))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
