"""Run a 1,000-line batch through fairgate with the official openai SDK.

Start the demo first (`make run`), then: `.venv/bin/python examples/batch_1000.py`.
"""

from __future__ import annotations

import io
import json
import sys
import time

import openai

BASE_URL = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000/v1"
MODEL = "llama-3.1-8b"


def main() -> None:
    client = openai.OpenAI(base_url=BASE_URL, api_key="sk-batch")
    lines = [json.dumps({"custom_id": f"q-{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": MODEL, "max_tokens": 64,
                                  "messages": [{"role": "user", "content": f"Question {i}"}]}})
             for i in range(1000)]
    upload = client.files.create(file=("questions.jsonl", io.BytesIO("\n".join(lines).encode())),
                                 purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"job": "demo"})
    started = time.monotonic()
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        time.sleep(1)
        batch = client.batches.retrieve(batch.id)
        counts = batch.request_counts
        done = counts.completed + counts.failed if counts else 0
        print(f"\r{batch.status:<12} {done:>5}/1000  {time.monotonic() - started:5.1f}s",
              end="", flush=True)
    print()
    if batch.output_file_id:
        results = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
        print(f"{len(results)} results; first: {results[0]['custom_id']} ->",
              results[0]["response"]["body"]["choices"][0]["message"]["content"][:60])


if __name__ == "__main__":
    main()
