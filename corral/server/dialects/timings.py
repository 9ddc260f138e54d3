"""llama-server's `timings` object, from the choices' Finished events: what /infill's
final object and the OpenAI routes carry beside their own counts, so a client written
for llama-server (llama.vscode, its web page) reads its rates and, with speculative
decoding, the drafted tokens (`draft_n`) and of those the accepted (`draft_n_accepted`)."""

from __future__ import annotations

from typing import Iterable

from corral.api.wire.common import Timings
from corral.server.pipeline.request import Finished


def timings(finals: Iterable[Finished]) -> Timings:
    """One choice's, or `n` choices' together: the prompt once (they share it), outputs
    and drafts summed, and the longest decode as its time (they decode side by side)."""
    ended = list(finals) or [Finished()]
    first = ended[0]
    prompt_ms = first.prompt_eval_duration / 1e6
    predicted_ms = max(f.eval_duration for f in ended) / 1e6
    prompt_n, predicted_n = first.prompt_eval_count, sum(f.eval_count for f in ended)
    return {"cache_n": first.cached_tokens, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
            "prompt_per_second": 1e3 * prompt_n / prompt_ms if prompt_ms else 0.0,
            "predicted_n": predicted_n, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / predicted_n if predicted_n else 0.0,
            "predicted_per_second": 1e3 * predicted_n / predicted_ms if predicted_ms else 0.0,
            "draft_n": sum(f.draft_count for f in ended),
            "draft_n_accepted": sum(f.draft_accepted_count for f in ended)}
