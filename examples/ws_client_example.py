"""Stream a chat completion over tidal's WebSocket endpoint and print the tokens as they arrive.

    tidal serve ...                       # in another terminal
    python examples/ws_client_example.py --url ws://127.0.0.1:8000/v1/ws "Tell me about tides"
"""

import argparse

import httpx
import trio

import sys

from tidal.tools.ws_client import TidalWSConnectError, TidalWSError, open_tidal_ws


async def first_model(http_url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(headers=headers) as client:
        response = await client.get(f"{http_url}/v1/models")
        response.raise_for_status()
        return response.json()["data"][0]["id"]


async def main(args: argparse.Namespace) -> None:
    try:
        await chat(args)
    except TidalWSConnectError as exc:
        sys.exit(f"ws_client_example: {exc}")
    except httpx.ConnectError:
        sys.exit(f"ws_client_example: could not reach {args.url}: connection refused (is `tidal serve` running there?)")


async def chat(args: argparse.Namespace) -> None:
    http_url = args.url.replace("ws://", "http://", 1).replace("wss://", "https://", 1).removesuffix("/v1/ws")
    model = args.model or await first_model(http_url, args.api_key)
    body = {
        "model": model,
        "messages": [{"role": "user", "content": args.prompt}],
        "max_tokens": args.max_tokens,
    }
    async with open_tidal_ws(args.url, api_key=args.api_key) as client:
        try:
            async with client.stream("chat.completions", body) as stream:
                async for data in stream:
                    for choice in data.get("choices", []):
                        print(choice.get("delta", {}).get("content") or "", end="", flush=True)
            print(f"\n\nusage: {stream.usage}")
        except TidalWSError as exc:
            print(f"\nserver error {exc.status}: {exc.error.get('message')}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt", nargs="?", default="Write a haiku about the sea.")
    parser.add_argument("--url", default="ws://127.0.0.1:8000/v1/ws")
    parser.add_argument("--model", default=None, help="default: the first model the server lists")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--max-tokens", type=int, default=128)
    trio.run(main, parser.parse_args())
