"""pagedserve.runtime."""
