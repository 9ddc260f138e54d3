"""Model names, the blob store, manifests, registry pulls, Modelfile/create, GGUF inspection."""
