"""Test helper: tiny random GGUFs of linear-attention hybrids, written with the `gguf`
package, as the pinned llama.cpp loads them.

Kimi-Linear (src/models/kimi-linear.cpp), Kimi-K3 and BailingMoE3: Kimi delta attention
(KDA) layers, where `head_count_kv` is 0, with q, k and v short convolutions and a
head_dim x head_dim state a head; the rest multi-head latent attention (MLA), whose
cache keeps one latent K a token (`kv_lora_rank` + the rope part) and no V. The three
differ in their KDA gates and in BailingMoE3's MTP block. MiniMax-Text-01
(src/models/minimax-01.cpp): lightning attention layers with a state a head, and a
softmax attention layer every `full_attention_interval` (8 when unsaid, as its GGUFs
leave it), its feed-forward a mixture of experts. No such model small enough for the
tests ships on PyPI. The vocabulary is the chat starter's; the weights mean nothing.

    python -m tests.linear_models CHAT_GGUF OUT.gguf --arch ARCH
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

import gguf
import numpy as np

from benchmarks.gpu_model import copy_tokenizer

Q8 = gguf.GGMLQuantizationType.Q8_0
EMBD, HEADS, FF = 64, 4, 128
Tensors = list[tuple[str, np.ndarray]]

# Kimi's and BailingMoE3's trunk: KDA, KDA, KDA, MLA (Kimi's pattern: one MLA in four)
KIMI_LAYERS = (0, 0, 0, 1)  # head_count_kv: 0 a KDA layer, 1 the MLA layer (MQA, one head)
KDA_DIM, CONV = 16, 4
KV_LORA, ROPE, NOPE, V_MLA = 32, 16, 16, 16
# MiniMax-Text-01: eight layers, the last softmax attention, two experts
MINIMAX_LAYERS, MINIMAX_KV, MINIMAX_DIM, EXPERTS = 8, 2, 16, 2


class _Writer:
    """A GGUF being written: its seeded random tensors, matrices in Q8_0 where their
    rows allow (tests.hybrid_model says why), the rest (convolutions, 3-d MLA
    projections, vectors) in F32."""

    def __init__(self, tokenizer: Path, dst: Path, arch: str, seed: int) -> None:
        reader = gguf.GGUFReader(str(tokenizer))
        self.n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
        self.rng = np.random.default_rng(seed)
        self.w = gguf.GGUFWriter(str(dst), arch)
        copy_tokenizer(reader, self.w)
        self.w.add_name(f"corral test {arch}")
        self.w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
        self.w.add_context_length(4096)
        self.w.add_embedding_length(EMBD)
        self.w.add_feed_forward_length(FF)
        self.w.add_head_count(HEADS)
        self.w.add_layer_norm_rms_eps(1e-5)

    def rand(self, *dims: int, std: float = 0.05) -> np.ndarray:  # numpy order: ggml's reversed
        return self.rng.normal(0.0, std, dims).astype(np.float32)

    def ones(self, n: int, scale: float = 1.0) -> np.ndarray:
        return (scale * (1.0 + self.rng.normal(0.0, 0.05, n))).astype(np.float32)

    def add(self, name: str, data: np.ndarray) -> None:
        if data.ndim == 2 and data.shape[-1] % 32 == 0:
            self.w.add_tensor(name, gguf.quants.quantize(data, Q8), raw_dtype=Q8)
        else:
            self.w.add_tensor(name, data)

    def close(self, sure: float) -> None:
        self.add("token_embd.weight", self.rand(self.n_vocab, EMBD, std=0.5))
        self.add("output_norm.weight", self.ones(EMBD, sure))
        self.add("output.weight", self.rand(self.n_vocab, EMBD))
        self.w.write_header_to_file()
        self.w.write_kv_data_to_file()
        self.w.write_tensors_to_file()
        self.w.close()


def write_kimi_linear(tokenizer: Path, dst: Path, seed: int = 0, sure: float = 8.0) -> Path:
    """A loadable Kimi-Linear; every layer's feed-forward dense (leading_dense_block_count
    covers them all), as the memory does not depend on it."""
    g = _kda_mla(tokenizer, dst, "kimi-linear", seed)
    g.w.add_uint32("kimi-linear.expert_gating_func", 2)  # sigmoid
    _kda_mla_layers(g, "kimi-linear", KIMI_LAYERS)
    g.close(sure)
    return dst


def write_kimi_k3(tokenizer: Path, dst: Path, seed: int = 0, sure: float = 8.0) -> Path:
    """A loadable Kimi-K3: Kimi-Linear's layers with a full-rank KDA gate and situ
    activations, no residual attention (attn_res.block_size 0), every feed-forward
    dense; its value_length the latent's, as converted."""
    arch = "kimi-k3"
    g = _kda_mla(tokenizer, dst, arch, seed)
    g.w.add_value_length(KV_LORA)
    g.w.add_uint32(f"{arch}.expert_gating_func", 2)
    g.w.add_uint32(f"{arch}.attn_res.block_size", 0)
    g.w.add_float32(f"{arch}.activation.situ_beta", 2.0)
    g.w.add_float32(f"{arch}.activation.situ_linear_beta", 2.0)
    _kda_mla_layers(g, arch, KIMI_LAYERS)
    g.close(sure)
    return dst


def write_bailingmoe3(tokenizer: Path, dst: Path, seed: int = 0, sure: float = 8.0) -> Path:
    """A loadable BailingMoE3 with its MTP block: KDA, KDA, KDA, MLA, then the `nextn`
    block (MLA, a mixture of experts), which the trunk's hybrid memory keeps KV for too
    (its attention filter is every layer that is not recurrent)."""
    arch = "bailingmoe3"
    g = _kda_mla(tokenizer, dst, arch, seed)
    g.w.add_uint32(f"{arch}.nextn_predict_layers", 1)
    g.w.add_float32(f"{arch}.kda.gate_lower_bound", -5.0)
    g.w.add_uint32(f"{arch}.expert_gating_func", 2)
    g.w.add_expert_count(EXPERTS)
    g.w.add_expert_used_count(1)
    _kda_mla_layers(g, arch, KIMI_LAYERS + (1,))
    g.close(sure)
    return dst


def _kda_mla(tokenizer: Path, dst: Path, arch: str, seed: int) -> _Writer:
    """The keys Kimi-Linear, Kimi-K3 and BailingMoE3 share, as their converters write
    them: KDA's head size and convolution, MLA's latent (key_length the latent K)."""
    g = _Writer(tokenizer, dst, arch, seed)
    g.w.add_uint32(f"{arch}.ssm.conv_kernel", CONV)
    g.w.add_uint32(f"{arch}.kda.head_dim", KDA_DIM)
    g.w.add_uint32(f"{arch}.attention.kv_lora_rank", KV_LORA)
    g.w.add_uint32(f"{arch}.rope.dimension_count", ROPE)
    g.w.add_key_length(KV_LORA + ROPE)
    g.w.add_uint32(f"{arch}.attention.key_length_mla", NOPE + ROPE)
    g.w.add_uint32(f"{arch}.attention.value_length_mla", V_MLA)
    g.w.add_uint32(f"{arch}.expert_feed_forward_length", FF)
    g.w.add_uint32(f"{arch}.expert_shared_count", 1)
    g.w.add_uint32(f"{arch}.leading_dense_block_count", len(KIMI_LAYERS))
    return g


def _kda_mla_layers(g: _Writer, arch: str, layers: tuple[int, ...]) -> None:
    """Every block's tensors; head_count_kv 0 a KDA block, past the trunk the MTP one."""
    g.w.add_block_count(len(layers))
    g.w.add_head_count_kv(list(layers))
    for i, n_kv in enumerate(layers):
        tensors = _mla(g, arch) if n_kv else _kda(g, arch)
        tensors += [("attn_norm.weight", g.ones(EMBD)), ("ffn_norm.weight", g.ones(EMBD))]
        tensors += _ffn(g) if i < len(KIMI_LAYERS) else _nextn(g)
        for name, data in tensors:
            g.add(f"blk.{i}.{name}", data)


def _ffn(g: _Writer) -> Tensors:
    return [("ffn_gate.weight", g.rand(FF, EMBD)), ("ffn_up.weight", g.rand(FF, EMBD)),
            ("ffn_down.weight", g.rand(EMBD, FF))]


def _nextn(g: _Writer) -> Tensors:
    """BailingMoE3's MTP block's own: experts with a shared one, and the projection of
    the token's embedding beside the hidden state."""
    return [("ffn_gate_inp.weight", g.rand(EXPERTS, EMBD)),
            ("exp_probs_b.bias", g.rand(EXPERTS)),
            ("ffn_gate_exps.weight", g.rand(EXPERTS, FF, EMBD)),
            ("ffn_up_exps.weight", g.rand(EXPERTS, FF, EMBD)),
            ("ffn_down_exps.weight", g.rand(EXPERTS, EMBD, FF)),
            *[(f"ffn_{x}_shexp.weight", g.rand(FF, EMBD)) for x in ("gate", "up")],
            ("ffn_down_shexp.weight", g.rand(EMBD, FF)),
            ("nextn.eh_proj.weight", g.rand(EMBD, 2 * EMBD)),
            ("nextn.enorm.weight", g.ones(EMBD)), ("nextn.hnorm.weight", g.ones(EMBD)),
            ("layer_output_norm.weight", g.ones(EMBD))]


def _kda(g: _Writer, arch: str) -> Tensors:
    """A KDA block as each loader reads it: Kimi-Linear's gates low-rank (f_a, f_b;
    g_a, g_b), Kimi-K3's output gate full-rank (ssm_g), BailingMoE3's f_a and g_a
    full-rank with no second half; the convolutions 3-d, BailingMoE3's 4-d."""
    inner = HEADS * KDA_DIM
    conv = (1, inner, 1, CONV) if arch == "bailingmoe3" else (inner, 1, CONV)
    out = [(f"ssm_conv1d_{x}.weight", g.rand(*conv, std=0.5)) for x in "qkv"]
    out += [(f"attn_{x}.weight", g.rand(inner, EMBD)) for x in "qkv"]
    a = (HEADS,) if arch == "kimi-k3" else (HEADS, 1)
    out += [("ssm_beta.weight", g.rand(HEADS, EMBD)),
            ("ssm_a", -np.abs(g.rand(*a, std=1.0))),  # -exp(A_log), as converted
            ("ssm_dt.bias", g.rand(inner, std=0.5)), ("ssm_norm.weight", g.ones(KDA_DIM)),
            ("attn_output.weight", g.rand(EMBD, inner))]
    if arch == "bailingmoe3":
        return out + [("ssm_f_a.weight", g.rand(inner, EMBD)),
                      ("ssm_g_a.weight", g.rand(inner, EMBD))]
    out += [("ssm_f_a.weight", g.rand(KDA_DIM, EMBD)),
            ("ssm_f_b.weight", g.rand(inner, KDA_DIM))]
    if arch == "kimi-k3":
        return out + [("ssm_g.weight", g.rand(inner, EMBD))]
    return out + [("ssm_g_a.weight", g.rand(KDA_DIM, EMBD)),
                  ("ssm_g_b.weight", g.rand(inner, KDA_DIM))]


def _mla(g: _Writer, arch: str) -> Tensors:
    """An MLA block as converted for the latent cache: wk_b and wv_b split, no wkv_b,
    no q compression; BailingMoE3's with a gate a head."""
    out = [("attn_q.weight", g.rand(HEADS * (NOPE + ROPE), EMBD)),
           ("attn_kv_a_mqa.weight", g.rand(KV_LORA + ROPE, EMBD)),
           ("attn_kv_a_norm.weight", g.ones(KV_LORA)),
           ("attn_k_b.weight", g.rand(HEADS, KV_LORA, NOPE)),
           ("attn_v_b.weight", g.rand(HEADS, V_MLA, KV_LORA)),
           ("attn_output.weight", g.rand(EMBD, HEADS * V_MLA))]
    if arch == "bailingmoe3":
        out.append(("attn_gate.weight", g.rand(HEADS, EMBD)))
    return out


def write_minimax(tokenizer: Path, dst: Path, seed: int = 0, sure: float = 8.0) -> Path:
    """A loadable MiniMax-Text-01 of eight layers, no `full_attention_interval` (its
    default of 8 makes the last layer the attention one)."""
    g = _Writer(tokenizer, dst, "minimax-01", seed)
    g.w.add_block_count(MINIMAX_LAYERS)
    g.w.add_head_count_kv(MINIMAX_KV)
    g.w.add_key_length(MINIMAX_DIM)
    g.w.add_value_length(MINIMAX_DIM)
    g.w.add_rope_dimension_count(MINIMAX_DIM // 2)
    g.w.add_rope_freq_base(10_000.0)
    g.w.add_float32("minimax-01.residual_scale", 1.0)
    g.w.add_expert_count(EXPERTS)
    g.w.add_expert_used_count(1)
    inner, kv = HEADS * MINIMAX_DIM, MINIMAX_KV * MINIMAX_DIM
    for i in range(MINIMAX_LAYERS):
        if (i + 1) % 8:
            tensors = [("attn_norm_2.weight", g.ones(inner)),
                       ("attn_qkv.weight", g.rand(3 * inner, EMBD)),
                       ("attn_gate.weight", g.rand(inner, EMBD))]
        else:
            tensors = [("attn_q.weight", g.rand(inner, EMBD)),
                       ("attn_k.weight", g.rand(kv, EMBD)), ("attn_v.weight", g.rand(kv, EMBD))]
        tensors += [("attn_norm.weight", g.ones(EMBD)), ("ffn_norm.weight", g.ones(EMBD)),
                    ("attn_output.weight", g.rand(EMBD, inner)),
                    ("ffn_gate_inp.weight", g.rand(EXPERTS, EMBD)),
                    ("ffn_gate_exps.weight", g.rand(EXPERTS, FF, EMBD)),
                    ("ffn_up_exps.weight", g.rand(EXPERTS, FF, EMBD)),
                    ("ffn_down_exps.weight", g.rand(EXPERTS, EMBD, FF))]
        for name, data in tensors:
            g.add(f"blk.{i}.{name}", data)
    g.close(sure)
    return dst


WRITERS: dict[str, Callable[[Path, Path], Path]] = {
    "kimi-linear": write_kimi_linear, "kimi-k3": write_kimi_k3,
    "bailingmoe3": write_bailingmoe3, "minimax-01": write_minimax}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tokenizer", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--arch", choices=sorted(WRITERS), default="kimi-linear")
    args = parser.parse_args()
    print(WRITERS[args.arch](args.tokenizer, args.out))


if __name__ == "__main__":
    main()
