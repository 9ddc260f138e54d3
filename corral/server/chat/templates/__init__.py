"""Chat templates: Ollama's Go TEMPLATE subset, sandboxed GGUF Jinja, and the fallback."""
