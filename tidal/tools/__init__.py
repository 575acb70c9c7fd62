"""Client tools that ship with tidal: the load generator (``tidal bench``) and the WebSocket client."""
