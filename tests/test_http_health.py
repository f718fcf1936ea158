"""HealthState as pure logic: phases, components, the combined readiness answer."""

from __future__ import annotations

import threading

from gateway.http.health import MAX_DETAIL_CHARS, NOT_REPORTED, HealthState, Phase


def test_ready_needs_the_ready_phase_and_every_component_healthy() -> None:
    health = HealthState()
    assert health.readiness().reasons == ("starting",)
    assert not health.readiness().ready
    assert health.set_ready()
    assert health.readiness().ready
    telegram = health.component("telegram")
    readiness = health.readiness()
    assert not readiness.ready
    assert readiness.reasons == (f"telegram: {NOT_REPORTED}",)
    telegram.healthy(True, "connected")
    assert health.readiness().ready
    telegram.healthy(False, "getUpdates: timed out")
    readiness = health.readiness()
    assert readiness.reasons == ("telegram: getUpdates: timed out",)
    assert readiness.as_json() == {
        "status": "unhealthy",
        "ready": False,
        "reasons": ["telegram: getUpdates: timed out"],
        "degraded": [],
        "components": {"telegram": {"healthy": False, "detail": "getUpdates: timed out"}},
    }


def test_an_optional_component_down_is_degraded_not_unready() -> None:
    health = HealthState()
    health.set_ready()
    cache = health.component("cache", required=False)
    cache.healthy(False, "redis refused")
    readiness = health.readiness()
    assert readiness.ready and readiness.reasons == ()
    assert readiness.degraded == ("cache: redis refused",)
    assert readiness.as_json()["status"] == "ready"
    health.component("sessions").healthy(False, "disk full")
    assert not health.readiness().ready


def test_reasons_combine_phase_and_components_in_a_stable_order() -> None:
    health = HealthState()
    health.component("slack").healthy(False, "")
    health.component("cache").healthy(False, "redis refused")
    assert health.readiness().reasons == ("starting", "cache: redis refused", "slack: unhealthy")
    assert health.readiness().as_json()["status"] == "starting"


def test_draining_is_one_way() -> None:
    health = HealthState()
    health.set_ready()
    assert health.accepting
    assert health.set_draining()
    assert not health.set_ready()
    assert not health.set_starting()
    assert health.phase is Phase.DRAINING
    assert not health.accepting
    assert health.readiness().reasons == ("draining",)
    assert health.readiness().as_json()["status"] == "draining"


def test_starting_again_is_allowed_before_draining() -> None:
    health = HealthState()
    health.set_ready()
    assert health.set_starting()
    assert not health.accepting


def test_the_same_name_reaches_the_same_component_and_details_are_bounded() -> None:
    health = HealthState()
    health.component("slack").healthy(True)
    health.component("slack")  # asking again does not reset it
    assert health.readiness().components["slack"].healthy
    health.component("slack").healthy(False, "line one\nline two " + "x" * 1000)
    detail = health.readiness().components["slack"].detail
    assert "\n" not in detail and len(detail) <= MAX_DETAIL_CHARS


def test_what_to_do_survives_a_long_detail() -> None:
    state = HealthState()
    fix = "start Redis, or point cache.url at a running one"
    state.component("cache").healthy(False, "redis cache at h:1: " + "x" * 500, fix=fix)
    detail = state.readiness().components["cache"].detail
    assert len(detail) == MAX_DETAIL_CHARS and detail.endswith("…; " + fix)
    state.component("cache").healthy(False, "short problem", fix=fix)
    assert state.readiness().components["cache"].detail == "short problem; " + fix


def test_since_changes_only_when_health_flips() -> None:
    now = [100.0]
    health = HealthState(clock=lambda: now[0])
    component = health.component("x")
    now[0] = 200.0
    component.healthy(True, "up")
    now[0] = 300.0
    component.healthy(True, "still up")
    assert health.readiness().components["x"].since == 200.0


def test_a_snapshot_does_not_change_under_the_reader() -> None:
    health = HealthState()
    health.component("a").healthy(True)
    snapshot = health.readiness()
    health.component("b")
    assert set(snapshot.components) == {"a"}


def test_concurrent_reports_and_reads_from_threads() -> None:
    health = HealthState()
    health.set_ready()
    errors: list[BaseException] = []

    def flip(name: str) -> None:
        try:
            handle = health.component(name)
            for i in range(2000):
                handle.healthy(i % 2 == 0, str(i))
                health.readiness()
            handle.healthy(True)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=flip, args=(f"c{i}",)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    readiness = health.readiness()
    assert readiness.ready and len(readiness.components) == 6
