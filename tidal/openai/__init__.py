"""OpenAI's API shapes: request parsing and validation, the admit -> first output -> answer service,
response encoding, streaming readers, choices, tool calls and token logprobs."""
