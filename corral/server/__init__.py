"""The daemon: the HTTP layer, native, OpenAI and management routes, and the model scheduler."""
