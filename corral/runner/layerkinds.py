"""Which layers of a model keep a KV cache and which a recurrent state, and what one
sequence's recurrent state holds: read from its GGUF's metadata as the pinned llama.cpp
reads it (src/models/*.cpp, llama_hparams::n_embd_r and n_embd_s), so that the fit
(runner.fitestimate) counts a hybrid's memory before the model loads.

A hybrid (LFM2, Qwen3.5, Nemotron-H, Granite-4-H, Jamba, Kimi-Linear and Kimi-K3,
BailingMoE3, MiniMax-Text-01) keeps attention KV only in its attention layers; its other
layers keep one fixed-size state a sequence, whatever the context. A recurrent model
(Mamba, RWKV) keeps only states. Counting every layer as attention KV, as a plain
transformer's estimate does, asks for several times the memory such a model takes, and
gives it fewer slots than fit.
"""

from __future__ import annotations

from dataclasses import dataclass

from corral.registry.gguf import GGUFInfo

RECURRENT = frozenset({"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"})
# Hybrids whose every layer keeps both (attention beside the SSM, in parallel).
BOTH = frozenset({"falcon-h1"})
# Hybrids whose recurrent layers are those with no KV heads (head_count_kv's zeros).
BY_KV_HEADS = frozenset({"lfm2", "lfm2moe", "granitehybrid", "jamba", "plamo2",
                         "nemotron_h", "nemotron_h_moe", "kimi-linear", "kimi-k3",
                         "bailingmoe3"})
# Hybrids whose model keeps KV for its MTP (`nextn`) blocks too, beside the head's own
# context: llama.cpp's hybrid memory for them takes every layer that is not recurrent,
# and those blocks are not (llama_model::create_memory, its filters left null).
NEXTN_KV = frozenset({"bailingmoe3"})
# Hybrids with one attention layer every `full_attention_interval` (the value here when
# unsaid: MiniMax-Text-01's GGUFs leave it out), unless `attention.recurrent_layers`
# lists them.
BY_INTERVAL = {"qwen35": 4, "qwen35moe": 4, "qwen3next": 4, "minimax-01": 8}
STATE_BYTES = 4  # llama.cpp keeps recurrent states in f32 (its type_r and type_s)
# The recurrent states a sequence keeps for taking back a rejected draft (n_rs_seq): a
# draft is at most this long on such a model. Each is a copy of every sequence's state
# (160 KB a sequence for LFM2-1.2B's short convolutions, tens of MB for Qwen3.5's
# delta-net), so fewer are kept where RS_SEQ of them would take more than SNAPSHOT_SHARE
# of the weights' bytes, and none (speculation off) where one would; a slot's
# checkpoints (runner.engine.plan Mark) are bounded by the same share.
RS_SEQ = 8
SNAPSHOT_SHARE = 0.1


def snapshot_planes(state: int, seqs: int, weights: int, most: int = RS_SEQ) -> int:
    """How many copies of its recurrent state each of `seqs` sequences keeps, each
    `state` bytes, beside `weights` bytes of weights: `most`, fewer where they would
    take more than SNAPSHOT_SHARE of the weights."""
    return min(most, int(SNAPSHOT_SHARE * weights) // max(state * seqs, 1))


@dataclass(frozen=True)
class LayerKinds:
    attention: int  # layers with a KV cache
    recurrent: int  # layers with a recurrent state
    state: int  # bytes of one sequence's recurrent state, all its recurrent layers


def layer_kinds(info: GGUFInfo) -> LayerKinds | None:
    """The model's layers by what they keep; None for a model whose every layer keeps KV
    (a transformer), or a hybrid this does not know (glm5-next, deepseek4, qwen4exp:
    the fit then counts every layer as KV, and no state or checkpoint, which asks for
    more KV than such a model takes and leaves out its states)."""
    arch, layers = info.architecture, _trunk_layers(info)
    if arch in RECURRENT:
        kinds = [False] * layers, [True] * layers
    elif arch in BOTH:
        kinds = [True] * layers, [True] * layers
    elif arch in BY_KV_HEADS or arch in BY_INTERVAL:
        kinds = _hybrid(info, layers)
    else:
        return None
    attention, recurrent = kinds
    state = _state_per_layer(info)
    if state is None or len(attention) != layers:
        return None
    nextn = (info.block_count or 0) - layers if arch in NEXTN_KV else 0
    return LayerKinds(sum(attention) + nextn, sum(recurrent), state * sum(recurrent))


def _trunk_layers(info: GGUFInfo) -> int:
    """The layers the model decodes with: block_count less the MTP blocks after them
    (those run in the head's own context: runner.llama.mtpcontext)."""
    nextn = info.metadata.get(f"{info.architecture}.nextn_predict_layers")
    return (info.block_count or 0) - (nextn if isinstance(nextn, int) else 0)


def _hybrid(info: GGUFInfo, layers: int) -> tuple[list[bool], list[bool]]:
    arch = info.architecture
    heads = _per_layer(info, "attention.head_count_kv", layers)
    listed = info.arrays.get(f"{arch}.attention.recurrent_layers")
    if listed is not None:
        recurrent = [bool(r) for r in listed[:layers]]
    elif arch in BY_INTERVAL:
        every = info.metadata.get(f"{arch}.full_attention_interval", BY_INTERVAL[arch])
        every = every if isinstance(every, int) and every > 0 else BY_INTERVAL[arch]
        recurrent = [(i + 1) % every != 0 for i in range(layers)]
    else:
        ffn = _per_layer(info, "feed_forward_length", layers)
        # Nemotron-H's layers without KV heads are recurrent only where they have no
        # feed-forward either: its MLP layers keep nothing (src/models/nemotron-h.cpp).
        nemotron = arch.startswith("nemotron_h")
        recurrent = [h == 0 and not (nemotron and f) for h, f in zip(heads, ffn)]
    attention = [not r and h > 0 for r, h in zip(recurrent, heads)]
    return attention, recurrent


def _per_layer(info: GGUFInfo, suffix: str, layers: int) -> list[int]:
    key = f"{info.architecture}.{suffix}"
    if key in info.arrays:
        return list(info.arrays[key][:layers])
    value = info.metadata.get(key)
    return [value if isinstance(value, int) else 0] * layers


def _layer_zero(info: GGUFInfo, suffix: str) -> int:
    values = _per_layer(info, suffix, 1)
    return values[0] if values else 0


def _state_per_layer(info: GGUFInfo) -> int | None:
    """One sequence's state in one recurrent layer, in bytes (n_embd_r + n_embd_s)."""
    arch, meta = info.architecture, info.metadata
    embd = info.embedding_length or 0

    def key(suffix: str) -> int:
        value = meta.get(f"{arch}.{suffix}")
        return value if isinstance(value, int) else 0

    if key("wkv.head_size"):  # RWKV: its token shifts (2 unless said) and its wkv state
        shifts = key("token_shift_count") or 2
        return STATE_BYTES * (shifts * embd + embd * key("wkv.head_size"))
    if key("shortconv.l_cache"):  # LFM2's short convolutions
        return STATE_BYTES * embd * (key("shortconv.l_cache") - 1)
    heads = _layer_zero(info, "attention.head_count")  # llama.cpp's n_head(): layer 0's
    if key("kda.head_dim"):  # Kimi's delta attention: the q, k and v convolutions' last
        # conv_kernel - 1 columns (3 where it is 0), and a head_dim x head_dim state a head
        dim, conv = key("kda.head_dim"), key("ssm.conv_kernel")
        return STATE_BYTES * (3 * (conv - 1 if conv else 3) * heads * dim + dim * dim * heads)
    if arch == "minimax-01":  # lightning attention: a head_dim x head_dim state a head,
        # and no convolution (its loader reads no ssm keys, so n_embd_r is 0)
        dim = key("attention.key_length") or embd // max(heads, 1)
        return STATE_BYTES * dim * dim * heads
    conv, inner, d_state = key("ssm.conv_kernel"), key("ssm.inner_size"), key("ssm.state_size")
    if not (inner and d_state):
        return None
    groups = key("ssm.group_count")
    return STATE_BYTES * (max(conv - 1, 0) * (inner + 2 * groups * d_state) + d_state * inner)
