"""Cores shared, not fought over: a thread budget for the runners, as pure policy.

Each runner's llama.cpp threads spin on every core while it decodes; two busy
runners on the same cores then slow each other far below half speed, each
preempting the other's spinning workers. The daemon instead splits the physical
cores between the runners that are busy (a remainder goes to the first ones), and
tells each runner its share whenever the set of busy runners changes
(`llama_set_n_threads` on the runner's engine thread). An idle runner is given
what it would get if it woke beside the busy ones, so its first step fits too.
"""

from __future__ import annotations


def shares(cores: int, busy: list[str], idle: list[str]) -> dict[str, int]:
    """Threads for each runner, by key: the busy ones split `cores`, at least one each."""
    out: dict[str, int] = {}
    if busy:
        base, extra = divmod(max(cores, 1), len(busy))
        for i, key in enumerate(sorted(busy)):
            out[key] = max(1, base + (1 if i < extra else 0))
    woken = max(1, max(cores, 1) // (len(busy) + 1))
    out.update({key: woken for key in idle})
    return out
