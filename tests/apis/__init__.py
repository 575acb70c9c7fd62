"""Tests of the agent APIs (tokenize, reasoning, Responses, Anthropic Messages) against one live server."""
