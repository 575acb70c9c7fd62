"""HTTP and WebSocket I/O: routes, the /v1/ws endpoint, the hypercorn send path, the connection bound, auth."""
