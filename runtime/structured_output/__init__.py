"""Structured outputs through llguidance: grammar compilation and per-sample token masks."""
