"""The four API dialects, each a thin layer over the one pipeline (server.pipeline):
parse a wire record into a request, render the events into its own bytes. A dialect's
generation route and the one stream policy are built here (`stream`), over HTTP."""
