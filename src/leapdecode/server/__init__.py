"""`leapdecode serve`: the OpenAI-compatible server."""
