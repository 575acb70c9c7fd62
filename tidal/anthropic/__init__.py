"""Anthropic's Messages API (``POST /v1/messages``) over the same admit -> first output -> answer path."""
