"""The stub's OpenAI-compatible HTTP server (FastAPI under uvicorn)."""
