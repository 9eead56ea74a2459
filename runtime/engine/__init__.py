"""The engine step (schedule, execute, update) and what surrounds it: the model runner, the async engine, detokenizing,
request limits and events.
"""
