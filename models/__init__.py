"""pagedserve.models."""
