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


class _Engine:
    """What the watchdog reads of an engine: its step's mark, and how it is told."""

    def __init__(self, clock: list[float]) -> None:
        import threading

        from corral.runner.watch import StepWatch

        self.watch = StepWatch(clock=lambda: clock[0])
        self.failed = threading.Event()
        self.stalls: list[tuple[float, float, str]] = []

    def stall(self, seconds: float, bound: float, first: object = None,
              what: str = "one step") -> None:
        self.stalls.append((seconds, bound, what))
        self.failed.set()


class _Vision:
    """The media thread, inside one encode since 0 s."""

    def __init__(self, clock: list[float]) -> None:
        from corral.runner.watch import StepWatch

        self.watch = StepWatch(clock=lambda: clock[0], first_grace=False)
        self.watch.enter("one media encode")


class _Service:
    def __init__(self, engine: _Engine, vision: _Vision | None) -> None:
        self.engine, self.vision = engine, vision

    def fail_streams(self, error: object) -> None: ...


def test_the_watchdog_gives_the_first_step_its_grace_and_watches_the_media_encode() -> None:
    from corral.runner.watch import FIRST_GRACE
    from corral.runner.process.main import watch_steps

    clock = [0.0]
    engine = _Engine(clock)
    engine.watch.enter()
    engine.watch.leave(worked=False)  # an idle pass of the loop: no decode yet
    engine.watch.enter()  # the first step after the load: the weights page in
    assert engine.watch.bound(10.0) == 10.0 * FIRST_GRACE

    def ticking() -> float:  # each read of the watchdog's is a second later
        clock[0] += 1.0
        return clock[0]

    engine.watch._clock = ticking
    watch_steps(_Service(engine, None), 10.0, every=0.001)  # type: ignore[arg-type]
    [(seconds, bound, what)] = engine.stalls  # declared past the grace, not the bound
    assert bound == 10.0 * FIRST_GRACE and seconds > bound and what == "one step"
    later = _Engine([0.0])
    later.watch.enter()
    later.watch.leave()  # a step that decoded: the grace is spent
    later.watch.enter()
    assert later.watch.bound(10.0) == 10.0
    later.watch._clock = lambda: 15.0
    watch_steps(_Service(later, None), 10.0, every=0.001)  # type: ignore[arg-type]
    assert later.stalls == [(15.0, 10.0, "one step")]
    media_clock = [0.0]
    quiet, media = _Engine([0.0]), _Vision(media_clock)
    media_clock[0] = 11.0  # no grace for a first encode: the weights are in by then
    watch_steps(_Service(quiet, media), 10.0, every=0.001)  # type: ignore[arg-type]
    assert quiet.stalls == [(11.0, 10.0, "one media encode")]
