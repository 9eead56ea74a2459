"""Speculative decoding: n-gram and draft-model proposers, the policy that sizes drafts, guided drafts."""
