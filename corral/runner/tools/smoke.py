"""Install-time smoke check: load a model and greedily decode a few tokens.

Run in a child process by install.sh, so a crash inside llama.cpp (an illegal
instruction from wrong build flags, say) shows up as an exit signal there.

    python -m corral.runner.tools.smoke [MODEL.gguf]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from corral.config import load_settings
from corral.registry.starter import starter_model_path
from corral.registry.store import Store


def decode_tokens(model_path: Path, prompt: str, n_tokens: int) -> tuple[str, float]:
    """Greedy-decode `n_tokens` after `prompt`; returns (text, tokens per second)."""
    import llama_cpp as L

    from corral.process import physical_cores
    from corral.runner.llama.native import init_backend, token_bytes, tokenize

    init_backend()
    mparams = L.llama_model_default_params()
    mparams.use_extra_bufts = True  # as the engine runs it by default
    model = L.llama_model_load_from_file(str(model_path).encode(), mparams)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {model_path}")
    cparams = L.llama_context_default_params()
    cparams.n_ctx = 256
    cparams.n_batch = cparams.n_ubatch = 256
    cparams.n_threads = cparams.n_threads_batch = physical_cores()
    ctx = L.llama_init_from_model(model, cparams)
    if not ctx:
        L.llama_model_free(model)
        raise RuntimeError("llama.cpp could not create a context")
    vocab = L.llama_model_get_vocab(model)
    chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
    L.llama_sampler_chain_add(chain, L.llama_sampler_init_greedy())
    try:
        tokens = tokenize(vocab, prompt, add_special=True)
        arr = (L.llama_token * len(tokens))(*tokens)
        if L.llama_decode(ctx, L.llama_batch_get_one(arr, len(tokens))) != 0:
            raise RuntimeError("llama_decode failed on the prompt")
        out = b""
        start = time.perf_counter()
        for _ in range(n_tokens):
            tok = L.llama_sampler_sample(chain, ctx, -1)
            if L.llama_vocab_is_eog(vocab, tok):
                break
            out += token_bytes(vocab, tok)
            one = (L.llama_token * 1)(tok)
            if L.llama_decode(ctx, L.llama_batch_get_one(one, 1)) != 0:
                raise RuntimeError("llama_decode failed while generating")
        rate = n_tokens / max(time.perf_counter() - start, 1e-9)
        return out.decode("utf-8", errors="replace"), rate
    finally:
        L.llama_sampler_free(chain)
        L.llama_free(ctx)
        L.llama_model_free(model)


def main(argv: list[str]) -> int:
    if argv:
        path: Path | None = Path(argv[0])
    else:
        path = starter_model_path(Store(load_settings().models))
    if path is None:
        import llama_cpp as L

        from corral.runner.llama.native import init_backend

        init_backend()
        print(f"llama.cpp loaded ({L.llama_print_system_info().decode().strip()}); "
              "no starter model to decode with")
        return 0
    try:
        text, rate = decode_tokens(path, "The capital of France is", 8)
    except RuntimeError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 1
    print(f"llama.cpp works: {text!r} ({rate:.1f} tok/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
