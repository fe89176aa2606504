"""The gateway's settings: config Structs, env/CLI overrides and secrets."""
