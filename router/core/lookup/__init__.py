"""vLLM 0.33.0's `get_computed_blocks`, predicted for every engine from the mirror."""
