"""The daemon: the HTTP transport, the four APIs (native, OpenAI, Anthropic, Responses) over
one request pipeline, management routes, the page, and the model scheduler."""
