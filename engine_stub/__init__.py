"""A vLLM-faithful simulated engine: block pool, scheduler, KV events and an OpenAI-compatible server."""
