"""The chat domain, below the request pipeline: messages and tools as typed records
(`messages`), a model described once (`models`), prompts rendered from chat templates
(`prompt`, `templates/`), the reply parser (`reply`, `harmony`) and image checks
(`images`). It imports nothing else of the server: no pipeline, no residency, no HTTP."""
