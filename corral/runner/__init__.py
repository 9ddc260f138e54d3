"""The runner layer: the llama.cpp engine (slots, batching, sampling, the prompt cache), the
runner process that serves one model, its client, and the runner wire."""
