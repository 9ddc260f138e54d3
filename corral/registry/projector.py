"""Projectors (mmproj GGUFs): what makes one fit a model, and what `show` says.

A projector holds a vision encoder, an audio encoder, or both (Qwen2.5-Omni). It is
checked from its header when a model is created and whenever a capability list is
built, so a model reports "vision" or "audio" only for an encoder its projector has
and the runner can load beside its weights. The create's trial load in a child
(runner.tools.probe) and the runner's load (llama.cpp's mtmd) check the rest.
"""

from __future__ import annotations

from typing import Any

from corral.registry.gguf import GGUFInfo

# Projectors whose image tokens take M-RoPE positions that the engine has not been
# checked against (tests/test_qwen_vl.py checks Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's
# against llama.cpp's own decode): refused rather than risked running wrong.
MROPE_TYPES = frozenset({"qwen2.5o", "glm4v", "glm5v", "paddleocr", "youtuvl", "hunyuanvl",
                         "mimovl"})


# Audio projectors the pinned llama.cpp loads and tokenizes but aborts on at their first
# encode: mtmd counts a window's tokens rounding down (187) where their encoder stacks
# frames rounding up (188), and clip_encode's check aborts the process. Refused by type,
# so a pulled one is refused too (a created one would be caught by the trial encode).
AUDIO_ABORTS = frozenset({"ultravox", "voxtral"})


def is_projector(info: GGUFInfo) -> bool:
    return info.architecture == "clip"


def projector_type(info: GGUFInfo) -> str:
    kind = info.metadata.get("clip.projector_type") or info.metadata.get(
        "clip.vision.projector_type") or info.metadata.get("clip.audio.projector_type")
    return kind if isinstance(kind, str) else ""


def projector_problem(projector: GGUFInfo, model: GGUFInfo) -> str | None:
    """Why this projector cannot serve this model, or None when it fits."""
    if not is_projector(projector):
        return "the projector is not a CLIP/mmproj GGUF"
    vision, audio = projector_media(projector)
    if not (vision or audio):
        return "the projector has no vision or audio encoder"
    kind = projector_type(projector)
    if not kind:
        return "the projector does not name its type (clip.projector_type)"
    if audio and kind in AUDIO_ABORTS:
        return (f"audio projectors of type {kind} abort the pinned llama.cpp at their first"
                " encode (it counts one token fewer than their encoder gives)")
    if kind in MROPE_TYPES:
        return (f"projectors of type {kind} (M-RoPE positions) are not supported yet;"
                " Qwen2-VL, Qwen2.5-VL and Qwen3-VL ones are")
    for encoder in ("vision", "audio"):
        width = projector.metadata.get(f"clip.{encoder}.projection_dim")
        if isinstance(width, int) and model.embedding_length and \
                width != model.embedding_length:
            which = "output" if encoder == "vision" else "audio output"
            return (f"the projector's {which} width ({width}) does not match the"
                    f" model's embedding length ({model.embedding_length})")
    return None


def projector_media(projector: GGUFInfo) -> tuple[bool, bool]:
    """(vision, audio): which encoders the projector says it has."""
    meta = projector.metadata
    return (meta.get("clip.has_vision_encoder") is True,
            meta.get("clip.has_audio_encoder") is True)


def projector_info(info: GGUFInfo) -> dict[str, Any]:
    """Ollama's `projector_info`: the projector's metadata, with its parameter count."""
    out: dict[str, Any] = {"general.architecture": info.architecture,
                           "general.parameter_count": info.parameter_count}
    for key, value in info.metadata.items():
        if key.startswith(("clip.", "general.")) and not (
                isinstance(value, list) and len(value) > 16):
            out[key] = value
    return out
