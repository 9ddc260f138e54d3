"""HTTP server, wire schema, error map, configuration and the client the CLI uses."""
