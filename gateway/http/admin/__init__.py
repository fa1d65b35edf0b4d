"""The admin API, one module per concern: who may call, state and drain, keys, usage, reload."""
