"""The OpenAI-compatible HTTP server (`ferrollm serve`)."""
