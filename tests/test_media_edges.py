"""The media edges' pure rules: no context shift under M-RoPE images, the disk cache's
namespace with the projector in it, and a draft that did not load taken out of the
fit on the side it was counted."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from corral.registry.gguf import GGUFInfo
from corral.runner import fitestimate
from corral.runner.cache.caches import caches_for
from corral.runner.engine.kvplan import shift_op
from corral.runner.jobs import ImageSpan, Job
from corral.runner.llama.context import EngineConfig
from corral.runner.slots.sequence import Sequence
from corral.runner.slots.slot import Slot, SlotState


def slot_with(images: tuple[ImageSpan, ...]) -> Slot:
    job = Job(prompt=list(range(40)), images=images)
    return Slot(0, 100, SlotState.DECODE, cached=list(range(90)), sequence=Sequence(job))


def test_no_context_shift_under_m_rope_images() -> None:
    """A shift moves token counts; an M-RoPE image's positions are not its token count,
    so a prompt that has one ends at the context ('length') instead of shifting."""
    embd = np.zeros((6, 4), dtype=np.float32)
    plain = ImageSpan(start=10, key=-1, embd=embd, non_causal=False)
    gridded = ImageSpan(start=10, key=-1, embd=embd, non_causal=True, n_pos=3, grid=(3, 2))
    assert shift_op(slot_with(()), True) is not None
    assert shift_op(slot_with((plain,)), True) is not None
    assert shift_op(slot_with((gridded,)), True) is None
    assert shift_op(slot_with(()), False) is None


def test_the_disk_cache_namespace_holds_the_projector(tmp_path: Path) -> None:
    model, one, two = (tmp_path / name for name in ("m.gguf", "a.mmproj", "b.mmproj"))
    model.write_bytes(b"m")
    one.write_bytes(b"projector one")
    two.write_bytes(b"projector two!")

    def space(projector: Path | None) -> str:
        cfg = EngineConfig(cache_disk=1 << 20, cache_dir=str(tmp_path / "kv"),
                           projector=str(projector or ""))
        disk = caches_for(str(model), cfg).disk
        assert disk is not None
        return disk.space

    spaces = {space(None), space(one), space(two)}
    assert len(spaces) == 3 and space(one) == space(one)


def test_a_draft_that_did_not_load_leaves_both_sides_of_the_fit() -> None:
    layers = {f"blk.{i}.w": 100 for i in range(4)}
    info = GGUFInfo(3, "llama", 1, 15, "Q4_1", 512, 4, 64, 4, 4, 16, 16, None, None,
                    {**layers, "token_embd": 50}, 0, 0)
    draft = 1000
    for free_vram, on_gpu in ((1 << 30, True), (250, False), (0, False)):
        est = fitestimate.estimate(info, 64, 1, free_vram, adapters=draft)
        less = est.without(draft)
        assert less.total == est.total - draft
        assert (less.gpu_bytes, less.cpu_bytes) == (
            (est.gpu_bytes - draft, est.cpu_bytes) if on_gpu else
            (est.gpu_bytes, est.cpu_bytes - draft))
