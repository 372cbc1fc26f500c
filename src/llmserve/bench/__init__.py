"""llmserve bench: load generation and reports against any OpenAI-compatible server."""
