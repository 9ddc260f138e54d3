"""The one request path every API dialect shares.

    dialect.parse(body) -> ChatTask | CompletionTask      (server.dialects)
    prepare(view, request, limits) -> Plan, a pure function     (server.pipeline.prepare)
    run(services, request) -> Piece* then Finished, per choice     (server.pipeline.run)
    respond(handler, events, renderer)                          (server.dialects.stream)

A dialect only translates: its wire record into a request here, and these events
into its own bytes. Capabilities, `think`, tools and `tool_choice`, grammars and
images are decided once, in `prepare`, against the model's view (server.chat.models);
holding the model, rendering the prompt and splitting the reply happen once, in
`run`; the stream policy (a real status before the first event, the API's
in-stream error after it) lives once, in `respond`, beside the dialects: the
pipeline ends at events, and imports nothing of HTTP.
"""
