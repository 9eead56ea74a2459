"""Sampling: the sampler, exact rejection sampling for speculative decoding, and their host and device ops."""
