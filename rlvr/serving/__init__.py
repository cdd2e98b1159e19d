"""Serving the trained policy: the OpenAI-compatible API's request logic (`api`), the server's
config (`config`) and the durable CSA stream host (`streams`)."""
