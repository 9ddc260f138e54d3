"""The GPU check's markdown table, from its JSON (benchmarks/gpu_check.py)."""

from __future__ import annotations

from typing import Any


def _mb(n: Any) -> str:
    return f"{n / 1e6:.0f} MB" if isinstance(n, (int, float)) and n else "—"


def _offload(checks: dict[str, Any]) -> list[str]:
    full, half = checks.get("full_offload", {}), checks.get("half_offload", {})
    lines = ["| check | result |", "|---|---|"]
    if "error" in full or "error" in half:
        return lines + [f"| offload | error: {full.get('error') or half.get('error')} |"]
    if full:
        same = ("equal" if full["equal"] else
                f"differ at token {full['first_difference']} (CPU margin "
                f"{full['cpu_margin_there']:.3f} nats)")
        lines.append(f"| 1. full offload: {full['tokens']} greedy tokens against the CPU | "
                     f"{same}; within tolerance: {full['within_tolerance']} |")
        lines.append(f"| 1. `ps` | size {_mb(full['size'])}, on the GPU {_mb(full['size_vram'])}"
                     f" ({'100% GPU' if full['all_on_gpu'] else full['skipped'] or 'split'}) |")
        if full.get("daemon_vram") is not None:
            lines.append(f"| 1. VRAM held by the daemon process itself | "
                         f"{_mb(full['daemon_vram']) if full['daemon_vram'] else 'none'} |")
    if half:
        error = half["estimate_error"]
        off = "" if error is None else f" (estimate {error:+.0%})"
        lines.append(f"| 2. half offload (num_gpu {half['num_gpu']}) | split "
                     f"{half['split_gpu']} on the GPU; estimate {_mb(half['estimate_vram'])}, "
                     f"nvidia-smi {_mb(half['nvidia_smi_vram'])}{off} |")
    return lines


def _levels(checks: dict[str, Any]) -> list[str]:
    ours = checks.get("corral", {}).get("levels", [])
    peer = {lv["c"]: lv for lv in checks.get("llama_server", {}).get("levels", [])}
    lines = ["", "| c | Corral tok/s | llama-server tok/s | ratio | Corral TTFT p50 | "
             "llama-server TTFT p50 |", "|---|---|---|---|---|---|"]
    for lv in ours:
        ref = peer.get(lv["c"])
        ratio = f"{lv['tok_s'] / ref['tok_s']:.2f}x" if ref and ref["tok_s"] else "—"
        lines.append(f"| {lv['c']} | {lv['tok_s']} | {ref['tok_s'] if ref else '—'} | {ratio} | "
                     f"{lv['ttft_p50_ms']} ms | {str(ref['ttft_p50_ms']) + ' ms' if ref else '—'} |")
    if "skipped" in checks.get("llama_server", {}):
        lines.append(f"\nllama-server: skipped ({checks['llama_server']['skipped']}).")
    return lines


def _cap_and_growth(checks: dict[str, Any]) -> list[str]:
    lines = [""]
    cap = checks.get("auto_cap", {})
    if "measured_cap" in cap:
        curve = ", ".join(f"c={lv['c']}: {lv['tok_s']}" for lv in cap["levels"])
        lines.append(f"4. Auto slot cap: measured {cap['measured_cap']} (guessed "
                     f"{cap['guessed_cap']}); aggregate tok/s {curve}.")
    growth = checks.get("corral", {}).get("growth")
    if growth:
        idle, top, after = growth["idle"], growth["busiest"], growth["after_quiet"]
        quiet = "" if after["seconds"] is None else f" {after['seconds']} s later"
        lines.append(f"5. Elastic KV: idle {idle['slots']} slot(s), {_mb(idle['size'])} "
                     f"(nvidia-smi {_mb(idle['nvidia_smi'])}); busiest {top['slots']} slots, "
                     f"{_mb(top['size'])} (nvidia-smi {_mb(top['nvidia_smi'])}); after quiet "
                     f"{after['slots']} slot(s), {_mb(after['size'])}{quiet}.")
    return lines


def table(result: dict[str, Any]) -> str:
    checks = result["checks"]
    model = checks.get("model", {})
    build = result["build_seconds"]
    head = [f"GPU check ({result['mode']}) on {result['gpu'] or 'no GPU'}; "
            f"CUDA build {'—' if build is None else build} s; "
            f"model: random llama {model.get('parameters', 0) / 1e9:.2f}B, F16 written in "
            f"{model.get('write_seconds', '—')} s, Q4_K_M in {model.get('quantize_seconds', '—')} s.",
            ""]
    errors = [f"- {k}: {v['error']}" for k, v in checks.items() if "error" in v]
    tail = ["", "Errors:", *errors] if errors else []
    return "\n".join(head + _offload(checks) + _levels(checks) + _cap_and_growth(checks)
                     + tail) + "\n"
