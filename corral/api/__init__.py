"""What a client needs, as in Ollama's api/: the wire types and the HTTP client."""
