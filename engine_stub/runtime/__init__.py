"""The simulated engine around the core: one asyncio runtime per DP rank, time model, faults."""
