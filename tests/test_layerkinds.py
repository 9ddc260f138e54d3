"""A hybrid's memory as the fit reckons it, against what the pinned llama.cpp allocates
for the same GGUF: the random LFM2 (short convolutions beside attention), Qwen3.5
(gated delta-net layers, one attention layer in four, an MTP block after them),
Kimi-Linear, Kimi-K3 and BailingMoE3 (delta attention beside latent attention; the last
with an MTP block the model keeps KV for) and MiniMax-Text-01 (lightning attention, one
softmax layer in eight) the tests write. Before, the fit counted every layer as
attention KV (issue 67)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import llama_cpp as L
import pytest

from corral.registry.gguf import inspect_gguf
from corral.runner import fitestimate
from corral.runner.layerkinds import layer_kinds, snapshot_planes
from corral.runner.llama import native, partial

# llama.cpp's state writes each cell's position and sequence ids (and M-RoPE's extra
# positions: Qwen3.5's cells take 24 bytes here, LFM2's 12)
CELL_SLACK = 32
HEADER_SLACK = 256  # and a few counts per cache and layer


def state_size(path: Path, n: int, flags: int) -> int:
    """One sequence's state after `n` tokens, in a context of that sequence alone."""
    native.init_backend()
    model = L.llama_model_load_from_file(str(path).encode(), L.llama_model_default_params())
    assert model
    try:
        size = partial.measure(model, 1, n, flags)
        assert size > 0
        return size
    finally:
        L.llama_model_free(model)


@pytest.fixture(scope="module", params=["lfm2", "qwen35", "kimi-linear", "kimi-k3",
                                        "bailingmoe3", "minimax-01"])
def hybrid(request: pytest.FixtureRequest, chat_gguf: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.hybrid_model import write_hybrid
    from tests.linear_models import WRITERS
    from tests.mtp_model import write_mtp

    writers: dict[str, Callable[[Path, Path], Path]] = {
        "lfm2": write_hybrid, "qwen35": write_mtp, **WRITERS}
    dst = tmp_path_factory.mktemp(request.param) / "model.gguf"
    return writers[request.param](chat_gguf, dst)


def test_the_state_and_the_attention_layers_are_llama_cpps(hybrid: Path) -> None:
    info = inspect_gguf(hybrid)
    kinds = layer_kinds(info)
    assert kinds is not None and 0 < kinds.attention < kinds.recurrent
    # The recurrent state: what a checkpoint holds (the partial state after a token).
    partial = state_size(hybrid, 1, L.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
    assert kinds.state <= partial <= kinds.state + HEADER_SLACK
    # The KV a token adds: its attention layers' only.
    per_token = state_size(hybrid, 9, 0) - state_size(hybrid, 8, 0)
    want = fitestimate.kv_bytes_per_token(info) // (info.block_count or 1) * kinds.attention
    assert want <= per_token <= want + CELL_SLACK


def test_the_fit_counts_states_and_checkpoints_not_every_layers_kv(hybrid: Path) -> None:
    info = inspect_gguf(hybrid)
    kinds = layer_kinds(info)
    assert kinds is not None
    slots, num_ctx = 4, 4096
    est = fitestimate.estimate(info, num_ctx, slots, 0)
    every_layer = fitestimate.kv_bytes_per_token(info) * num_ctx * slots
    attention = every_layer // (info.block_count or 1) * kinds.attention
    weights = sum(info.tensor_bytes.values())
    planes = snapshot_planes(kinds.state, slots + 1, weights)
    held = attention + kinds.state * (slots + 1) * (1 + planes)
    assert held - est.layers < est.kv <= held < every_layer // 2  # est.kv: whole layers
    # of which the copies for taking back drafts, which the runner measures in their place
    assert est.snapshots == kinds.state * (slots + 1) * planes > 0
    # with speculation off the runner makes no copies (test_hybrid), nor does the fit
    off = fitestimate.estimate(info, num_ctx, slots, 0, speculative=False)
    assert off.snapshots == 0 and abs(est.total - off.total - est.snapshots) < est.layers
    # as many tokens as fit (no cap: a tiny model's attention-only KV fits more than 2^20)
    pool = fitestimate.pool_tokens_that_fit(info, 1 << 30, 1 << 30, slots)
    assert pool > (1 << 30) // 2 // fitestimate.kv_bytes_per_token(info)  # attention's only
    kept = snapshot_planes(kinds.state, slots, weights, fitestimate.CHECKPOINTS)
    assert est.checkpoints == kinds.state * slots * kept


def test_a_transformer_has_no_layer_kinds(starter_gguf: Path) -> None:
    assert layer_kinds(inspect_gguf(starter_gguf)) is None
