"""Where Ray runs the tensor-parallel ranks: one placement group, decided up front (as vLLM does).

Rank 0 always runs in the driver process, so the driver's node is where placement starts.

    CPU (shared-memory collectives)            GPU (NCCL), e.g. TP=3, driver node A has 2 free GPUs
    node A (driver)   node B                   node A (driver)          node B
    rank 0 (driver)                            bundle 0 {GPU:1} rank 0  bundle 2 {GPU:1} rank 2
    bundle 0 {CPU:1} rank 1                    bundle 1 {GPU:1} rank 1
    bundle 1 {CPU:1} rank 2

- CPU: ranks 1..N-1 each reserve one CPU, all on the driver's node (STRICT_PACK, each bundle selected by
  the node's `ray.io/node-id` label): shared memory does not cross hosts. Too few free CPUs there is a
  ValueError naming them, before anything is loaded.
- GPU: one bundle of one GPU per rank, rank 0's included (a placeholder actor holds it and tells the driver
  its index). As many bundles as the driver's node has free GPUs are pinned to it; only the rest go to
  other nodes (PACK: as few as possible). Too few free GPUs (or none on the driver's node, where rank 0
  must run) is a ValueError naming the count per node.

The free counts come from Ray's per-node view at start; if they change before Ray reserves the group,
the wait for it is bounded and ends in the same kind of error. The group is removed at shutdown.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import structlog

log = structlog.get_logger("pagedserve.engine")

NODE_ID_LABEL = "ray.io/node-id"  # set by Ray on every node
PLACEMENT_TIMEOUT_S = 60.0


@dataclasses.dataclass
class RankPlacement:
    """A reserved placement group and where it put each rank."""

    group: Any  # ray.util.placement_group.PlacementGroup
    driver_node: str
    rank_bundles: list[int | None]  # rank r's bundle index; None = no bundle (CPU rank 0, the driver)
    bundle_nodes: list[str]  # node id of each bundle, as Ray reserved it

    @property
    def rank_nodes(self) -> list[str]:
        """Node id of every rank, rank 0 first."""
        return [self.driver_node if b is None else self.bundle_nodes[b] for b in self.rank_bundles]


def free_resources_per_node(ray: Any) -> dict[str, dict[str, float]]:
    """{node id: {resource: free amount}} over the live nodes (totals where Ray does not say what is free)."""
    try:
        from ray._private.state import available_resources_per_node  # what vLLM reads too; private in Ray
        free = available_resources_per_node()
    except (ImportError, AttributeError):
        free = None
    nodes = {n["NodeID"]: n for n in ray.nodes() if n.get("Alive")}
    if free is None:
        return {nid: dict(n["Resources"]) for nid, n in nodes.items()}
    return {nid: dict(free.get(nid, {})) for nid in nodes}


def describe_node(ray: Any, node_id: str) -> str:
    for n in ray.nodes():
        if n["NodeID"] == node_id:
            return f"{node_id[:12]} ({n.get('NodeManagerAddress', '?')})"
    return node_id[:12]


def plan_bundles(world_size: int, use_gpu: bool, driver_node: str,
                 free: dict[str, dict[str, float]]) -> tuple[list[dict], list[dict], str, list[int | None]]:
    """(bundles, their label selectors, strategy, each rank's bundle), or ValueError naming what is missing.

    Pure: `free` is {node id: {resource: free amount}} as free_resources_per_node returns it."""
    here = free.get(driver_node, {})
    if not use_gpu:
        need, have = world_size - 1, here.get("CPU", 0.0)
        if have < need:
            raise ValueError(
                f"tensor_parallel_size {world_size} on CPU keeps ranks 1..{world_size - 1} on the driver's Ray node "
                f"(shared memory does not cross hosts), one CPU each: they need {need} CPU there but node "
                f"{driver_node[:12]} has {have:g} free; free some, lower tensor_parallel_size, or use GPUs (NCCL) "
                f"across hosts")
        return ([{"CPU": 1.0} for _ in range(need)], [{NODE_ID_LABEL: driver_node} for _ in range(need)],
                "STRICT_PACK", [None, *range(need)])
    gpus = {node: int(res.get("GPU", 0.0)) for node, res in free.items()}
    local = min(world_size, gpus.get(driver_node, 0))
    order = sorted(gpus, key=lambda node: (node != driver_node, node))  # the driver's node first
    counts = ", ".join(f"{node[:12]}{' (driver)' if node == driver_node else ''}: {gpus[node]}" for node in order)
    if local == 0:
        raise ValueError(f"tensor_parallel_size {world_size} on GPUs runs rank 0 in this process, so the driver's Ray "
                         f"node needs a free GPU; free GPUs per node: {counts}")
    if sum(gpus.values()) < world_size:
        raise ValueError(f"tensor_parallel_size {world_size} needs {world_size} GPU (one per rank) but the Ray cluster "
                         f"has {sum(gpus.values())} free; free GPUs per node: {counts}")
    selectors = [{NODE_ID_LABEL: driver_node} for _ in range(local)]
    selectors += [{NODE_ID_LABEL: "!" + driver_node} for _ in range(world_size - local)]
    return [{"GPU": 1.0} for _ in range(world_size)], selectors, "PACK", list(range(world_size))


def place_ranks(ray: Any, world_size: int, use_gpu: bool, timeout_s: float = PLACEMENT_TIMEOUT_S) -> RankPlacement:
    """Reserve the ranks' placement group in the cluster `ray` is connected to (see the module docstring)."""
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    driver_node = ray.get_runtime_context().get_node_id()
    bundles, selectors, strategy, rank_bundles = plan_bundles(world_size, use_gpu, driver_node,
                                                              free_resources_per_node(ray))
    group = placement_group(bundles, strategy=strategy, bundle_label_selector=selectors,
                            name=f"pagedserve-tp{world_size}")
    try:
        ready, _ = ray.wait([group.ready()], timeout=timeout_s)
        if not ready:
            raise ValueError(f"Ray did not reserve the ranks' resources ({strategy} of {bundles}, driver node "
                             f"{describe_node(ray, driver_node)}) within {timeout_s:g} s: another job took them; "
                             f"see `ray status`")
        table = placement_group_table(group)["bundles_to_node_id"]
        placement = RankPlacement(group, driver_node, rank_bundles, [table[i] for i in range(len(bundles))])
        misplaced = [i for i, node in enumerate(placement.bundle_nodes)
                     if not _matches(selectors[i][NODE_ID_LABEL], node)]
        if misplaced:  # Ray broke its own label selectors: say so rather than run ranks in the wrong place
            raise RuntimeError(f"Ray placed bundles {misplaced} outside their selectors {selectors}: "
                               f"{placement.bundle_nodes}")
    except BaseException:
        remove_placement_group(group)
        raise
    log.info("executor.ray_placement", tensor_parallel_size=world_size, resource="GPU" if use_gpu else "CPU",
             strategy=strategy, driver_node=driver_node, rank_nodes=placement.rank_nodes,
             nodes_used=len(set(placement.rank_nodes)))
    return placement


def actor_options(placement: RankPlacement, rank: int, use_gpu: bool, env: dict[str, str] | None = None) -> dict:
    """Ray options that start rank `rank`'s actor inside its reserved bundle."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle = placement.rank_bundles[rank]
    strategy = PlacementGroupSchedulingStrategy(placement.group, placement_group_bundle_index=bundle)
    return dict(num_cpus=0 if use_gpu else 1, num_gpus=1 if use_gpu else 0, max_restarts=0,
                scheduling_strategy=strategy, runtime_env={"env_vars": env or {}})


class GpuHolder:
    """Holds rank 0's GPU bundle on the driver's node: the driver asks it which device Ray reserved."""

    def gpu_ids(self) -> list[str]:
        import ray

        return [str(g) for g in ray.get_runtime_context().get_accelerator_ids()["GPU"]]


def reserve_rank0_gpu(ray: Any, placement: RankPlacement, visible: str | None,
                      timeout_s: float = PLACEMENT_TIMEOUT_S) -> tuple[Any, int]:
    """(the placeholder actor holding rank 0's GPU, that GPU's index in this process)."""
    holder = ray.remote(GpuHolder).options(**actor_options(placement, 0, use_gpu=True)).remote()
    try:
        (gpu,) = ray.get(holder.gpu_ids.remote(), timeout=timeout_s)
        return holder, gpu_index(gpu, visible)
    except BaseException:
        ray.kill(holder)
        raise


def _matches(selector: str, node: str) -> bool:
    return node != selector[1:] if selector.startswith("!") else node == selector


def gpu_index(ray_gpu_id: str, visible: str | None) -> int:
    """The CUDA device index, in a process that sees `visible` (CUDA_VISIBLE_DEVICES), of the GPU Ray calls
    `ray_gpu_id` (Ray's ids are the raylet's device ids)."""
    if visible:
        ids = [v.strip() for v in visible.split(",")]
        if ray_gpu_id not in ids:
            raise ValueError(f"Ray gave rank 0 GPU {ray_gpu_id}, which CUDA_VISIBLE_DEVICES={visible!r} hides from "
                             f"this process; unset it or start the Ray node with the same devices")
        return ids.index(ray_gpu_id)
    return int(ray_gpu_id)
