"""The engine boundary seen from the frontend: the engine client (one child process), replicas, the router."""
