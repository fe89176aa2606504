"""HTTP serving plumbing shared by the gateway and the engine stub: a socket bound up front, a
uvicorn server that stops quietly. Imports neither `router` nor `engine_stub`, so both may use it."""
