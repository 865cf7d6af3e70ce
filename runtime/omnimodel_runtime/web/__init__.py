"""HTTP plumbing the stage server and the gateway share (ASGI level, no routes of their own)."""
