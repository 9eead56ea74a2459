"""KV cache groups: how a model's layers share the block pool (vLLM's hybrid KV cache manager is the model).

A group is a set of layers that read one block table; every group draws block ids from the one pool. A
model with only global layers is one group. Gemma 3 has global layers and sliding-window layers (window W):
their layers are cut into groups of equal size (kv_cache_groups), each with a table per sequence
(kv_cache_manager.py), so one block id means a block of every one of the `num_tensors` K/V array pairs, used
by the layer of the group it was handed to.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class KVCacheGroups:
    """How a model's layers share the block pool: the groups' windows (None: global attention) and, per layer,
    its group and the K/V array pair (tensor) that holds it. One block id is a block of every tensor; a
    layer writes and reads it only when the block belongs to its group's table."""

    windows: tuple[int | None, ...]
    layer_group: tuple[int, ...]
    layer_tensor: tuple[int, ...]
    num_tensors: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_tensors", max(self.layer_tensor, default=-1) + 1)


def kv_cache_groups(layer_windows: Sequence[int | None]) -> KVCacheGroups:
    """Groups for layers with these windows (None: global). All layers alike: one group, a tensor per layer
    (the layout without groups). Else, as vLLM does, each kind's layers are cut in order into groups of the
    smallest kind's count (the largest's, when that is within 25% of it): Gemma 3 270M's 3 global and 15
    local layers make 1 + 5 groups of 3 layers over 3 tensors, so a block id costs 3 layers' K/V, not 18::

        layer    0  1  2  3  4  5 |  6 ... 11 | 12 ... 17       (5, 11, 17 global; W = 512 elsewhere)
        group    1  1  1  2  2  0 |  2 3 3 3 4 0 | ...
        tensor   0  1  2  0  1  0 |  ...
    """
    windows = [None if w is None else check_window(w) for w in layer_windows]
    if not windows:
        raise ValueError("kv_cache_groups: a model has at least one layer")
    kinds = list(dict.fromkeys(windows))  # in order of first appearance
    if len(kinds) == 1:
        return KVCacheGroups((kinds[0],), (0,) * len(windows), tuple(range(len(windows))))
    counts = [windows.count(k) for k in kinds]
    size = max(counts) if max(counts) < 1.25 * min(counts) else min(counts)
    group_windows: list[int | None] = []
    first_group = {}
    for kind, count in zip(kinds, counts):
        first_group[kind] = len(group_windows)
        group_windows += [kind] * -(-count // size)
    seen = dict.fromkeys(kinds, 0)
    layer_group, layer_tensor = [], []
    for w in windows:
        i = seen[w]
        seen[w] += 1
        layer_group.append(first_group[w] + i // size)
        layer_tensor.append(i % size)
    return KVCacheGroups(tuple(group_windows), tuple(layer_group), tuple(layer_tensor))


def check_window(window: object) -> int:
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        raise ValueError(f"sliding_window must be None or a positive int, got {window!r}")
    return window
