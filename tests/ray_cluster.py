"""A real two-node Ray cluster on loopback for the Ray executor tests (ray.cluster_utils.Cluster).

    head   127.0.0.1  2 CPUs, 2 GPUs (declared only: placement tests, no GPU code runs)
    second 127.0.0.2  2 CPUs, 2 GPUs

Both nodes are on this host (all of 127/8 is loopback on Linux), so a driver started here attaches to the
head, as Ray prefers; `ray_node_entry.py` runs the CLI attached to another node instead. Ray would bind
to the host's network address; RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 keeps every node and driver on
loopback, and `env()` carries it and RAY_ADDRESS to the servers the tests start.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


@dataclasses.dataclass
class TwoNodeCluster:
    cluster: Any  # ray.cluster_utils.Cluster
    head_id: str
    second_id: str

    @property
    def address(self) -> str:
        return self.cluster.address

    def env(self) -> dict[str, str]:
        return {**LOOPBACK_ENV, "RAY_ADDRESS": self.address}

    def add_node(self, ip: str, **resources: Any) -> Any:
        node = self.cluster.add_node(node_ip_address=ip, **resources)
        self.cluster.wait_for_nodes()
        return node


def start_cluster() -> TwoNodeCluster:
    os.environ.update(LOOPBACK_ENV)
    import ray
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    ray_constants.ENABLE_RAY_CLUSTER = False  # read at import: the env var alone is late if ray was imported
    cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=2, num_gpus=2, include_dashboard=False,
                                                                node_ip_address="127.0.0.1"))
    try:
        second = cluster.add_node(num_cpus=2, num_gpus=2, node_ip_address="127.0.0.2")
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        return TwoNodeCluster(cluster, cluster.head_node.node_id, second.node_id)
    except BaseException:
        cluster.shutdown()
        raise


def stop_cluster(c: TwoNodeCluster) -> None:
    import ray

    ray.shutdown()
    c.cluster.shutdown()


def free(ray: Any, node_id: str, resource: str) -> float:
    from pagedserve.runtime.executor.ray_placement import free_resources_per_node

    return free_resources_per_node(ray).get(node_id, {}).get(resource, 0.0)


def hold(ray: Any, node_id: str, resource: str, amount: float) -> Any:
    """Reserve `amount` of `resource` on one node (a placement group), as another job would."""
    from ray.util.placement_group import placement_group

    from pagedserve.runtime.executor.ray_placement import NODE_ID_LABEL

    group = placement_group([{resource: amount}], strategy="STRICT_PACK",
                            bundle_label_selector=[{NODE_ID_LABEL: node_id}])
    ready, _ = ray.wait([group.ready()], timeout=60)
    assert ready, f"could not hold {amount} {resource} on {node_id}"
    return group


def alive(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie awaiting its parent's wait counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
