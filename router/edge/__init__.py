"""The HTTP edge: the ASGI app, the client leg, the upstream leg and the admin routes."""
