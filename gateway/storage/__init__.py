"""Redis: the connection boundary, the key and value schema, the Lua scripts and the store that
runs them, the embedded Valkey."""
