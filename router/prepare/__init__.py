"""A request body to what routing needs: tokens, block keys and the engine variants."""
