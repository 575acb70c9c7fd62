"""The engine: runs in its own process (``python -m tidal.gpu``), owns the model and the KV cache.

Never imports trio, quart or hypercorn; talks to the frontend only through ``tidal.wire``.
"""
