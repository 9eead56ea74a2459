"""`pagedserve` run as a Ray driver attached to the Ray node at $TEST_RAY_DRIVER_IP (run as a script).

On a real cluster a server runs on a host with one Ray node; the tests' nodes share this host, where Ray
attaches a driver to the head. This makes the server's own node another one, as on a second host."""

from __future__ import annotations

import functools
import os
import sys

import ray

if __name__ == "__main__":
    ray.init = functools.partial(ray.init, _node_ip_address=os.environ["TEST_RAY_DRIVER_IP"])
    from pagedserve.sidecar.cli import main

    sys.exit(main(sys.argv[1:]))
