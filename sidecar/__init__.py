"""pagedserve.sidecar."""
