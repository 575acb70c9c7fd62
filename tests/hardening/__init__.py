"""Hardening tests: what a hostile client can send must not crash, stall or poison the server."""
