"""Observation: metrics, each request's timeline and its spans, the server's /state."""
