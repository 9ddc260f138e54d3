"""Ollama-style tables and human formats: no borders, 4-space gaps, uppercase headers."""

from __future__ import annotations

import datetime as dt
import time
from typing import Any, Sequence


def human_bytes(n: float) -> str:
    """Decimal units as Ollama prints them: 253 MB, 2.0 GB."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            v = n / scale
            return f"{v:.0f} {unit}" if v >= 10 or v == int(v) else f"{v:.1f} {unit}"
    return f"{int(n)} B"


def _span(seconds: float) -> str:
    s = int(seconds)
    if s < 1:
        return "Less than a second"
    if s < 60:
        return "1 second" if s == 1 else f"{s} seconds"
    if s < 120:
        return "About a minute"
    if s < 3600:
        return f"{s // 60} minutes"
    if s < 7200:
        return "About an hour"
    if s < 48 * 3600:
        return f"{s // 3600} hours"
    if s < 14 * 86400:
        return f"{s // 86400} days"
    if s < 60 * 86400:
        return f"{s // (7 * 86400)} weeks"
    if s < 730 * 86400:
        return f"{s // (30 * 86400)} months"
    return f"{s // (365 * 86400)} years"


def human_count(n: Any) -> str:
    """A parameter count as Ollama prints it: 471.20K, 135M, 8.03B."""
    if not isinstance(n, int) or n <= 0:
        return ""
    for size, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def human_ago(then: float, now: float | None = None) -> str:
    return _span((time.time() if now is None else now) - then) + " ago"


def human_until(when: float, now: float | None = None) -> str:
    delta = when - (time.time() if now is None else now)
    if delta > 20 * 365 * 86400:
        return "Forever"
    if delta < 0:
        return "Stopping..."
    return _span(delta) + " from now"


def parse_time(text: str) -> float:
    """RFC3339 with up to 9 fractional digits, as the daemon sends it."""
    text = text.replace("Z", "+00:00")
    if "." in text:
        head, rest = text.split(".", 1)
        digits = "".join(ch for ch in rest if ch.isdigit())
        tz = rest[len(digits):]
        text = f"{head}.{digits[:6].ljust(6, '0')}{tz}"
    return dt.datetime.fromisoformat(text).timestamp()


def processor(size: int, vram: int, rpc: int = 0) -> str:
    """Where a model's bytes are, as Ollama shows it; RPC workers are a third place."""
    if size <= 0:
        return "100% CPU"
    places = [(p, round(n / size * 100)) for p, n in
              (("CPU", size - vram - rpc), ("GPU", vram), ("RPC", rpc)) if n > 0]
    if len(places) == 1:
        return f"100% {places[0][0]}"
    return "/".join(f"{pct}%" for _, pct in places) + " " + "/".join(p for p, _ in places)


def render(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row)]
    lines = []
    for row in [list(headers), *rows]:
        cells = [cell.ljust(w) for cell, w in zip(row, widths)]
        lines.append("    ".join(cells).rstrip())
    return "\n".join(lines)


def models_table(models: list[dict[str, Any]]) -> str:
    rows = [[_named(m), m["digest"][:12], human_bytes(m["size"]),
             human_ago(parse_time(m["modified_at"]))] for m in models]
    return render(["NAME", "ID", "SIZE", "MODIFIED"], rows)


def ps_table(models: list[dict[str, Any]]) -> str:
    """Ollama's columns, and CAP beside SIZE: what the model holds now, and what it may
    grow to as requests run at once (elastic KV), which is what fitting others counts."""
    rows = [[_named(m), m["digest"][:12], human_bytes(m["size"]),
             human_bytes(m["size_cap"]) if "size_cap" in m else "",
             processor(m["size"], m.get("size_vram", 0), m.get("size_rpc", 0)),
             str(m.get("context_length", "")),
             human_until(parse_time(m["expires_at"]))] for m in models]
    return render(["NAME", "ID", "SIZE", "CAP", "PROCESSOR", "CONTEXT", "UNTIL"], rows)


def _named(model: dict[str, Any]) -> str:
    """A loaded model's name, and its draft model's where one drafts for it."""
    draft = model.get("draft")
    if not draft:
        return str(model["name"])
    name = draft.get("model") or draft.get("digest", "")[7:19]
    return f"{model['name']} (draft {name}{' off: it did not load' if draft.get('error') else ''})"


def show_text(info: dict[str, Any]) -> str:
    """`corral show MODEL` sections."""
    mi = info.get("model_info", {})
    arch = mi.get("general.architecture", "")
    details = info.get("details", {})
    out = ["  Model"]
    rows = [("architecture", arch), ("parameters", details.get("parameter_size", "")),
            ("context length", mi.get(f"{arch}.context_length", "")),
            ("embedding length", mi.get(f"{arch}.embedding_length", "")),
            ("quantization", details.get("quantization_level", ""))]
    out += [f"    {k:<20}{v}" for k, v in rows if v != ""]
    out += ["", "  Capabilities"] + [f"    {c}" for c in info.get("capabilities", [])]
    projector = info.get("projector_info")
    if projector:
        rows = [("architecture", projector.get("general.architecture", "")),
                ("type", projector.get("clip.projector_type", "")),
                ("parameters", human_count(projector.get("general.parameter_count", 0))),
                ("embedding length", projector.get("clip.vision.embedding_length", "")),
                ("dimensions", projector.get("clip.vision.projection_dim", "")),
                ("image size", projector.get("clip.vision.image_size", "")),
                ("audio embedding", projector.get("clip.audio.embedding_length", "")),
                ("audio dimensions", projector.get("clip.audio.projection_dim", "")),
                ("mel bins", projector.get("clip.audio.num_mel_bins", ""))]
        out += ["", "  Projector"] + [f"    {k:<20}{v}" for k, v in rows if v != ""]
    draft = info.get("draft")
    if draft:  # a Modelfile's DRAFT: the model that drafts for speculative decoding
        d = draft.get("details", {})
        rows = [("model", draft.get("model", "")), ("architecture", d.get("family", "")),
                ("parameters", d.get("parameter_size", "")),
                ("quantization", d.get("quantization_level", ""))]
        out += ["", "  Draft"] + [f"    {k:<20}{v}" for k, v in rows if v]
    if info.get("parameters"):
        out += ["", "  Parameters"] + [f"    {line}" for line in info["parameters"].splitlines()]
    if "tensors" in info:  # a verbose show
        width = max((len(k) for k in mi), default=0) + 4
        out += ["", "  Metadata"] + [f"    {k:<{width}}{summarize(v)}" for k, v in sorted(mi.items())]
        out += ["", "  Tensors"] + [f"    {t['name']:<32}{t['type']:<8}{t['shape']}"
                                    for t in info["tensors"]]
    for title, key in (("System", "system"), ("License", "license")):
        text = [line for line in (info.get(key) or "").splitlines() if line.strip()]
        if text:
            out += ["", f"  {title}"] + [f"    {line}" for line in text[:2]]
            if len(text) > 2:
                out.append("    ...")
    return "\n".join(out) + "\n"


SUMMARY_ITEMS = 3  # array items shown before the count


def summarize(value: Any) -> str:
    """A metadata value on a terminal: long arrays as their first items and a count."""
    if isinstance(value, list) and len(value) > SUMMARY_ITEMS:
        head = ", ".join(repr(v) if isinstance(v, str) else str(v)
                         for v in value[:SUMMARY_ITEMS])
        return f"[{head}, ...] ({len(value)} items)"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def go_duration(ns: int) -> str:
    """Go's time.Duration.String(): 1.2345678s, 130.079ms, 12µs."""
    if ns < 1000:
        return f"{ns}ns"
    for unit, scale in (("µs", 1e3), ("ms", 1e6)):
        if ns < scale * 1000:
            return f"{ns / scale:.6f}".rstrip("0").rstrip(".") + unit
    seconds = ns / 1e9
    if seconds < 60:
        return f"{seconds:.9f}".rstrip("0").rstrip(".") + "s"
    minutes, secs = divmod(seconds, 60)
    hours, minutes = divmod(int(minutes), 60)
    text = f"{minutes}m" + (f"{secs:.9f}".rstrip("0").rstrip(".") + "s")
    return (f"{hours}h" if hours else "") + text


def verbose_stats(final: dict[str, Any]) -> str:
    lines = []

    def add(label: str, value: str) -> None:
        lines.append(f"{label + ':':<22}{value}")

    if final.get("total_duration"):
        add("total duration", go_duration(final["total_duration"]))
    if final.get("load_duration"):
        add("load duration", go_duration(final["load_duration"]))
    for prefix, label in (("prompt_eval", "prompt eval"), ("eval", "eval")):
        count, dur = final.get(f"{prefix}_count", 0), final.get(f"{prefix}_duration", 0)
        if count:
            add(f"{label} count", f"{count} token(s)")
        if dur:
            add(f"{label} duration", go_duration(dur))
            add(f"{label} rate", f"{count / (dur / 1e9):.2f} tokens/s")
    drafted = final.get("draft_count", 0)  # speculative decoding; Ollama sends none
    if drafted:
        accepted = final.get("draft_accepted_count", 0)
        add("draft count", f"{drafted} token(s)")
        add("draft accepted", f"{accepted} token(s)")
        add("acceptance rate", f"{100 * accepted / drafted:.2f}%")
    return "\n".join(lines)
