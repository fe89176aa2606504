"""The router's block keys: hashing a block's tokens, from requests and from events."""
