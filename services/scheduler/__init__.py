"""The scheduler process: admission, continuous batching, KV block allocation, finishing."""
