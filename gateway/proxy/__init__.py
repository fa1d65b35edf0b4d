"""One request to vLLM and back: reading the body, the endpoint table, forwarding, relaying the
stream."""
