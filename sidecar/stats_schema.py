"""EngineStats (runtime/outputs.py, the one stats schema) on the wire: GetServerStats' pb.ServerStats.

Every EngineStats field goes on the wire under its own name, or the one WIRE_NAMES gives it, unless
NOT_ON_WIRE names it: the wire contract (protos/pagedserve/v1/generation.proto) changes only on purpose,
with a new proto field and a regenerated stub. `kv_transfer` is spread into its KVTransferStats counters
(but KV_NOT_ON_WIRE), read live rather than from the snapshot. ServerStats' remaining field, uptime_s, is
the server's own. The client's ServerStats is made from the message (client_types.py), and the Prometheus
metrics read the same EngineStats through metrics.ENGINE_METRICS. tests/sidecar/test_stats_schema.py
fails when a field reaches neither without being named here or there.
"""

from __future__ import annotations

import dataclasses

from pagedserve.runtime.core.sched_policy import DEFAULT_TENANT
from pagedserve.runtime.kv_transfer.kv_connector import KVTransferStats
from pagedserve.runtime.outputs import EngineStats

from .pb import generation_pb2 as pb

# EngineStats field -> its ServerStats field, where the names differ.
WIRE_NAMES: dict[str, str] = {
    "num_kv_blocks_used": "kv_blocks_used",
    "num_kv_blocks_total": "kv_blocks_total",
    "kv_token_slot_utilization": "kv_utilization",
}
# EngineStats fields with no ServerStats field (yet): in the logs and the metrics only.
NOT_ON_WIRE: frozenset[str] = frozenset({
    "prefix_cache_request_hit_rate", "num_shared_blocks", "num_exclusive_blocks", "kv_bytes_used",
    "kv_bytes_without_sharing",
    "tenants",  # every tenant's row: only the caller's own goes on the wire, as TENANT_FIELDS below
})
# ServerStats fields of the caller's own tenant: its TenantStats row, by these names.
TENANT_FIELDS: dict[str, str] = {"tenant": "name", "tenant_num_running": "num_running",
                                 "tenant_num_waiting": "num_waiting", "tenant_tokens_served": "tokens_served"}
# EngineStats fields spread into their own fields, each under its own name.
NESTED = "kv_transfer"
KV_NOT_ON_WIRE: frozenset[str] = frozenset({"fallback_reasons"})  # a dict of reason -> count
# ServerStats fields that are the server's, not the engine's.
SERVER_FIELDS: tuple[str, ...] = ("uptime_s",) + tuple(TENANT_FIELDS)

ENGINE_WIRE_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(EngineStats)
                                            if f.name not in NOT_ON_WIRE and f.name != NESTED)
KV_WIRE_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(KVTransferStats)
                                        if f.name not in KV_NOT_ON_WIRE)


def server_stats_message(stats: EngineStats, kv: KVTransferStats, uptime_s: float,
                         tenant: str | None = None) -> pb.ServerStats:
    """GetServerStats' answer: the snapshot `stats`, the live KV-transfer counters `kv`, the uptime, and the
    calling `tenant`'s own row (None: the one default tenant)."""
    values = {WIRE_NAMES.get(name, name): getattr(stats, name) for name in ENGINE_WIRE_FIELDS}
    values.update({name: getattr(kv, name) for name in KV_WIRE_FIELDS})
    row = stats.tenant(tenant or DEFAULT_TENANT)
    values.update({wire: getattr(row, name) for wire, name in TENANT_FIELDS.items()})
    return pb.ServerStats(uptime_s=uptime_s, **values)
