"""One chat request through a running fairgate demo, with the official ``openai`` SDK.

    make run              # terminal 1: the demo
    make try              # terminal 2: this script (make try PORT=8001 for another port)
"""

from __future__ import annotations

import argparse
import sys

import openai


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--key", default="sk-alice", help="a demo API key")
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    base_url = f"http://{args.host}:{args.port}/v1"
    client = openai.OpenAI(base_url=base_url, api_key=args.key, max_retries=0, timeout=30)
    try:
        reply = client.chat.completions.create(
            model=args.model,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=args.max_tokens,
        )
    except openai.APIConnectionError:
        print(f"nothing answers at {base_url}: start the demo with `make run` "
              f"(and use the same PORT for both)", file=sys.stderr)
        return 2
    except openai.APIStatusError as exc:
        print(f"{base_url} answered {exc.status_code}: {exc.message}", file=sys.stderr)
        return 1
    print(reply.choices[0].message.content)
    if reply.usage is not None:
        print(f"({reply.usage.prompt_tokens} prompt + {reply.usage.completion_tokens} "
              f"completion tokens, model {reply.model})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
