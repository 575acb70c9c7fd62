"""Use the official openai SDK against tidal: a streaming chat completion.

    pip install openai
    tidal serve ...                       # in another terminal
    python examples/openai_client_example.py "Tell me about tides"
"""

import argparse

from openai import OpenAI


def main(args: argparse.Namespace) -> None:
    # tidal ignores the key unless started with one; the SDK insists on some value.
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = args.model or client.models.list().data[0].id
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": args.prompt}],
        max_tokens=args.max_tokens,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        if chunk.usage:
            print(f"\n\nusage: {chunk.usage.prompt_tokens} prompt + {chunk.usage.completion_tokens} completion tokens")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt", nargs="?", default="Write a haiku about the sea.")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--model", default=None, help="default: the first model the server lists")
    parser.add_argument("--max-tokens", type=int, default=128)
    main(parser.parse_args())
