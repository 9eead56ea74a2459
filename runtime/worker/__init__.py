"""A rank's worker: the model, its KV caches, CUDA graphs and the memory budgets (arrays live here)."""
