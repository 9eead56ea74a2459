"""Generated protobuf and gRPC stubs for protos/pagedserve/v1/*.proto (do not edit; see below).

Regenerate with `python scripts/gen_protos.py` after changing a .proto; CI runs
`python scripts/gen_protos.py --check` (tests/sidecar/test_protos_fresh.py) to catch stale files.
Import the modules themselves, e.g. `from pagedserve.sidecar.pb import generation_pb2`; this package
imports nothing, so loading it costs nothing.
"""
