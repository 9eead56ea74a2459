"""The engine's state without arrays: requests, the block pool, the KV cache manager, the scheduler, sequence groups
and beams.
"""
