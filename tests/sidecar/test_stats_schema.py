"""One stats schema: every EngineStats field (runtime/outputs.py) reaches the wire, the client and the
Prometheus metrics, or is named as left out in one declared place (sidecar/stats_schema.py for the wire,
sidecar/metrics.py NOT_METRICS for the metrics). Adding a field to EngineStats and nothing else fails here
only if the generic paths cannot carry it."""

from __future__ import annotations

import dataclasses

from pagedserve.runtime.kv_transfer.kv_connector import KVTransferStats
from pagedserve.runtime.outputs import EngineInfo, EngineStats, TenantStats
from pagedserve.sidecar import client_types, metrics, stats_schema
from pagedserve.sidecar.pb import generation_pb2 as pb

ENGINE_FIELDS = [f.name for f in dataclasses.fields(EngineStats)]
WIRE_FIELDS = [f.name for f in pb.ServerStats.DESCRIPTOR.fields]


def _distinct(cls: type, start: int) -> dict:
    """A value per field of `cls`, each different from the others and from the proto's default."""
    values = {}
    for i, f in enumerate(dataclasses.fields(cls), start):
        if f.name == stats_schema.NESTED:
            values[f.name] = KVTransferStats(**_distinct(KVTransferStats, 100))
        elif f.name == "tenants":
            values[f.name] = (TenantStats("default", i, i + 1, i + 2, 1.5, i + 3.5, i + 4.5),
                              TenantStats("other", i + 5, i + 6, i + 7))
        elif f.type == "int":
            values[f.name] = i
        elif f.type == "float":
            values[f.name] = i + 0.5
        elif f.type == "str":
            values[f.name] = f"value-{i}"
        elif f.name in stats_schema.KV_NOT_ON_WIRE and cls is KVTransferStats:
            values[f.name] = {"reason": i}
        else:
            raise AssertionError(f"{cls.__name__}.{f.name}: type {f.type!r} has no test value; give it one here, "
                                 f"and a way onto the wire and into the metrics")
    return values


def _stats() -> EngineStats:
    return EngineStats(**_distinct(EngineStats, 1))


def test_declared_names_are_fields():
    """The tables name real fields, so an exclusion cannot outlive the field it was for."""
    assert set(stats_schema.WIRE_NAMES) <= set(ENGINE_FIELDS)
    assert stats_schema.NOT_ON_WIRE <= set(ENGINE_FIELDS)
    assert stats_schema.NESTED in ENGINE_FIELDS
    assert stats_schema.KV_NOT_ON_WIRE <= {f.name for f in dataclasses.fields(KVTransferStats)}
    assert set(stats_schema.SERVER_FIELDS) <= set(WIRE_FIELDS)
    assert set(metrics.NOT_METRICS) <= set(ENGINE_FIELDS)
    for m in metrics.ENGINE_METRICS:
        assert set(m.covers) <= set(ENGINE_FIELDS), m.name
    assert not set(metrics.NOT_METRICS) & {name for m in metrics.ENGINE_METRICS for name in m.covers}


def _off_the_wire(stats: EngineStats) -> list[str]:
    """The fields of `stats` that the client does not get back, with their values, and are not declared off."""
    msg = stats_schema.server_stats_message(stats, stats.kv_transfer, uptime_s=12345.25)
    got = client_types._from_message(client_types.ServerStats, msg)
    assert got.uptime_s == 12345.25
    missing = []
    for f in dataclasses.fields(stats):
        name = f.name
        if name in stats_schema.NOT_ON_WIRE:
            continue
        if name == stats_schema.NESTED:
            missing += [f"{name}.{k.name}" for k in dataclasses.fields(KVTransferStats)
                        if k.name not in stats_schema.KV_NOT_ON_WIRE
                        and getattr(got, k.name, None) != getattr(stats.kv_transfer, k.name)]
            continue
        if getattr(got, stats_schema.WIRE_NAMES.get(name, name), None) != getattr(stats, name):
            missing.append(name)
    return missing


def test_every_engine_stat_reaches_the_client_or_is_declared_off_the_wire():
    missing = _off_the_wire(_stats())
    assert not missing, (f"EngineStats fields that reach no ServerStats field: {missing}. Add one to "
                         f"protos/pagedserve/v1/generation.proto, or name them in sidecar/stats_schema.py "
                         f"(WIRE_NAMES when the wire's name differs, NOT_ON_WIRE to keep them off)")


def test_every_wire_field_is_filled():
    """Conversely, no ServerStats field is left at its default: each comes from EngineStats or the server."""
    stats = _stats()
    msg = stats_schema.server_stats_message(stats, stats.kv_transfer, uptime_s=1.5)
    defaults = {f.name: f.default_value for f in pb.ServerStats.DESCRIPTOR.fields}
    unfilled = [name for name in WIRE_FIELDS if getattr(msg, name) == defaults[name]]
    assert not unfilled, f"ServerStats fields nothing fills: {unfilled}"


def test_client_dataclasses_are_the_messages():
    for cls, msg in ((client_types.ServerStats, pb.ServerStats), (client_types.ModelInfo, pb.ModelInfo),
                     (client_types.Usage, pb.Usage)):
        assert [f.name for f in dataclasses.fields(cls)] == [f.name for f in msg.DESCRIPTOR.fields], cls
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen


def test_model_info_on_the_wire_is_engine_info_and_the_name():
    engine_info = {f.name for f in dataclasses.fields(EngineInfo)}
    assert {f.name for f in pb.ModelInfo.DESCRIPTOR.fields} == {"name"} | engine_info


class _FakeEngine:
    """What the metrics read of an AsyncEngine (its read API), with distinct values."""

    def __init__(self, stats: EngineStats) -> None:
        self.stats = stats
        self.num_waiting = 7001
        self.memory_budget_bytes = 7002

    def prefix_cache_counts(self) -> tuple[int, int]:
        return 7003, 7004


def _scrape(engine) -> dict[str, float]:
    out = {}
    for family in metrics._EngineCollector(lambda: engine).collect():
        for s in family.samples:
            out[s.name] = s.value
    return out


def _not_in_metrics(stats: EngineStats) -> list[str]:
    """The fields of `stats` that no scraped metric carries and NOT_METRICS does not name."""
    engine = _FakeEngine(stats)
    scraped = _scrape(engine)
    for m in metrics.ENGINE_METRICS:
        sample = m.name + ("_total" if m.kind == "counter" else "")
        assert scraped[sample] == m.value(engine, stats), m.name
    named = {name for m in metrics.ENGINE_METRICS for name in m.covers}
    return [f.name for f in dataclasses.fields(stats) if f.name not in named and f.name not in metrics.NOT_METRICS
            and scraped.get(f"pagedserve_engine_{f.name}") != getattr(stats, f.name)]


def test_every_engine_stat_reaches_the_metrics_or_is_declared_left_out():
    missing = _not_in_metrics(_stats())
    assert not missing, (f"EngineStats fields that reach no metric: {missing}. Give each a row in "
                         f"sidecar/metrics.py ENGINE_METRICS, make it a number (exported as "
                         f"pagedserve_engine_<field>), or name it in NOT_METRICS")


def test_named_metrics_read_the_live_figures():
    scraped = _scrape(_FakeEngine(_stats()))
    assert scraped["pagedserve_num_requests_waiting"] == 7001  # AsyncEngine.num_waiting, not the snapshot's
    assert scraped["pagedserve_memory_budget_bytes"] == 7002
    assert scraped["pagedserve_prefix_cache_queries_total"] == 7003
    assert scraped["pagedserve_prefix_cache_hits_total"] == 7004


def test_a_new_field_with_no_way_out_fails_the_checks():
    """The checks above catch a field added to EngineStats that the generic paths cannot carry: a number has
    no wire field until the proto gets one; a string has no metric."""
    extended = dataclasses.make_dataclass("Extended", [("new_count", int, dataclasses.field(default=0)),
                                                       ("new_label", str, dataclasses.field(default=""))],
                                          bases=(EngineStats,))
    stats = extended(**_distinct(EngineStats, 1), new_count=999, new_label="label")
    assert _off_the_wire(stats) == ["new_count", "new_label"]
    assert _not_in_metrics(stats) == ["new_label"]  # the number goes out as pagedserve_engine_new_count


def test_each_tenant_row_reaches_the_metrics_by_its_label():
    stats = _stats()
    samples = {(s.name, s.labels.get("tenant")): s.value
               for family in metrics._EngineCollector(lambda: _FakeEngine(stats)).collect() for s in family.samples}
    for row in stats.tenants:
        assert samples[("pagedserve_tenant_num_requests_running", row.name)] == row.num_running
        assert samples[("pagedserve_tenant_num_requests_waiting", row.name)] == row.num_waiting
        assert samples[("pagedserve_tenant_tokens_served_total", row.name)] == row.tokens_served


def test_the_wire_carries_the_callers_own_tenant_row_only():
    stats = _stats()
    mine = stats_schema.server_stats_message(stats, stats.kv_transfer, 1.0, tenant="other")
    assert (mine.tenant, mine.tenant_num_running, mine.tenant_num_waiting, mine.tenant_tokens_served) == \
        ("other", stats.tenants[1].num_running, stats.tenants[1].num_waiting, stats.tenants[1].tokens_served)
    unknown = stats_schema.server_stats_message(stats, stats.kv_transfer, 1.0, tenant="nobody")
    assert (unknown.tenant, unknown.tenant_num_running, unknown.tenant_tokens_served) == ("nobody", 0, 0)
