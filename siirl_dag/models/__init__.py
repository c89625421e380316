"""Facts about a model, read from its Hugging Face config.json (no torch here): `shape` (parameter
counts and KV size, for the memory plan) and `lora` (the adapters it trains and serves)."""
