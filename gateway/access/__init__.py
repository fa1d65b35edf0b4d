"""Who may call: API keys, the runtime keyring, operator sessions."""
