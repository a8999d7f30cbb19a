from __future__ import annotations

from dataclasses import replace

import pytest

from engine.errors import InsufficientMemory, SparkError
from engine.hw.memory import MemoryPressure
from engine.hw.policy import DecisionKind, HardwarePolicy, Mode, PolicyConfig, PolicyDecision
from engine.hw.thermal import ThermalState
from tests.engine.hw.fakes import FakeMemory, FakeThermal, FakeTime

GB = 2**30
N, F, S, C = ThermalState.NOMINAL, ThermalState.FAIR, ThermalState.SERIOUS, ThermalState.CRITICAL


def make(
    mode: Mode = Mode.BALANCED, **config: object
) -> tuple[HardwarePolicy, FakeThermal, FakeMemory, FakeTime, list[PolicyDecision]]:
    thermal, memory, t = FakeThermal(), FakeMemory(), FakeTime()
    policy = HardwarePolicy(thermal, memory, mode, PolicyConfig(**config), clock=t.clock, sleep=t.sleep)  # type: ignore[arg-type]
    events: list[PolicyDecision] = []
    policy.subscribe(events.append)
    return policy, thermal, memory, t, events


def never() -> bool:
    return False


def test_full_thermal_cycle_nominal_serious_critical_pause_cool_resume() -> None:
    policy, thermal, _memory, t, events = make(Mode.BALANCED, poll_interval_s=1.0, pause_poll_s=0.5)

    # nominal: full chunks, no sleeps, no decisions
    assert policy.prefill_chunk(256) == 256
    policy.before_step(never)
    assert t.sleeps == [] and events == []

    # serious (seen at the next poll): throttle decision, chunks shrink, cool-down between tokens
    thermal.state = S
    t.now += 1.0
    policy.before_step(never)
    assert [(e.kind, e.reason) for e in events] == [(DecisionKind.THROTTLE, "throttled: thermal serious")]
    assert events[0].parameters["prefill_chunk_cap"] == 64 and events[0].parameters["mode"] == "balanced"
    assert t.sleeps == [0.02]
    assert policy.prefill_chunk(256) == 64 and policy.prefill_chunk(16) == 16
    assert policy.max_batch(8) == 2

    # critical: before_step holds, polling every 0.5 s, until it cools to serious on the third poll
    thermal.state = C
    t.now += 1.0
    t.on_sleep = [lambda: None, lambda: None, lambda: setattr(thermal, "state", S)]
    policy.before_step(never)
    assert [e.kind for e in events[1:]] == [DecisionKind.PAUSE, DecisionKind.RESUME]
    assert events[1].reason == "paused: thermal critical"
    assert events[2].reason == "resumed: thermal serious" and events[2].parameters["cooldown_s"] == 0.02
    assert t.sleeps[1:] == [0.5, 0.5, 0.5, 0.02]  # three pause polls, then the serious cool-down
    assert not policy.state.paused

    # cools fully: unthrottle, full chunks and no more sleeps
    thermal.state = N
    t.now += 1.0
    policy.before_step(never)
    assert (events[-1].kind, events[-1].reason) == (DecisionKind.UNTHROTTLE, "full speed: thermal nominal")
    assert policy.prefill_chunk(256) == 256
    assert len(t.sleeps) == 5


def test_should_stop_ends_a_pause() -> None:
    policy, thermal, _memory, t, events = make()
    thermal.state = C
    stops = iter([False, False, True])
    policy.before_step(lambda: next(stops))
    assert t.sleeps == [0.5, 0.5]  # two polls, then the stop is seen; no cool-down after a stop
    assert [e.kind for e in events] == [DecisionKind.PAUSE]
    assert policy.state.paused  # still critical: the next generation holds too


def test_critical_to_nominal_resumes_without_a_separate_unthrottle() -> None:
    policy, thermal, _memory, t, events = make()
    thermal.state = C
    t.on_sleep = [lambda: setattr(thermal, "state", N)]
    policy.before_step(never)
    assert [(e.kind, e.reason) for e in events] == [
        (DecisionKind.PAUSE, "paused: thermal critical"),
        (DecisionKind.RESUME, "resumed: thermal nominal"),
    ]
    assert events[1].parameters["prefill_chunk_cap"] is None and t.sleeps == [0.5]


def test_sources_are_read_at_most_once_per_poll_interval_unless_notified() -> None:
    policy, thermal, _memory, _t, events = make(poll_interval_s=1.0)
    policy.before_step(never)
    policy.before_step(never)
    policy.prefill_chunk(256)
    assert thermal.reads == 1
    thermal.change(S)  # a notification makes the next step read at once, before the interval is up
    policy.before_step(never)
    assert thermal.reads == 2 and [e.kind for e in events] == [DecisionKind.THROTTLE]
    policy.close()
    assert thermal.callbacks == []


@pytest.mark.parametrize(
    ("mode", "fair_chunk", "serious_chunk", "serious_cooldown"),
    [(Mode.PERFORMANCE, 256, 128, 0.005), (Mode.BALANCED, 256, 64, 0.02), (Mode.EFFICIENCY, 128, 32, 0.05)],
)
def test_modes_throttle_differently(mode: Mode, fair_chunk: int, serious_chunk: int, serious_cooldown: float) -> None:
    policy, thermal, _memory, t, _events = make(mode)
    thermal.state = F
    policy.refresh()
    assert policy.prefill_chunk(256) == fair_chunk
    thermal.state = S
    policy.refresh()
    assert policy.prefill_chunk(256) == serious_chunk
    policy.before_step(never)
    assert t.sleeps[-1] == serious_cooldown


def test_changing_mode_re_evaluates_and_announces() -> None:
    policy, thermal, _memory, _t, events = make(Mode.BALANCED)
    thermal.state = F
    policy.refresh()
    assert events == []  # balanced does nothing at fair
    policy.set_mode(Mode.EFFICIENCY)
    assert (events[-1].kind, events[-1].reason, events[-1].parameters["mode"]) == (
        DecisionKind.THROTTLE,
        "throttled: thermal fair",
        "efficiency",
    )
    policy.set_mode(Mode.PERFORMANCE)
    assert events[-1].kind is DecisionKind.UNTHROTTLE


def test_unknown_thermal_state_never_throttles() -> None:
    policy, thermal, _memory, t, events = make(Mode.BALANCED)
    thermal.state = ThermalState.UNKNOWN
    policy.before_step(never)
    assert policy.prefill_chunk(256) == 256 and t.sleeps == [] and events == []
    assert policy.state.thermal is ThermalState.UNKNOWN


def test_preferred_backend_prefers_efficiency_when_hot_or_in_efficiency_mode() -> None:
    policy, thermal, _memory, _t, _events = make(Mode.BALANCED)
    assert policy.preferred_backend(["coreml", "mps", "cpu"]) is None  # cool: keep the auto order
    thermal.state = S
    policy.refresh()
    assert policy.preferred_backend(["coreml", "mps", "cuda", "cpu"]) == "coreml"
    assert policy.preferred_backend(["cuda", "mps", "cpu"]) == "mps"
    assert policy.preferred_backend(["cuda", "cpu"]) == "cpu"
    efficient, *_ = make(Mode.EFFICIENCY)
    assert efficient.preferred_backend(["mps", "cpu"]) == "mps"


def test_memory_pressure_spills_and_recovers() -> None:
    policy, _thermal, memory, _t, events = make()
    assert policy.under_pressure() is False and events == []
    memory.snap = replace(memory.snap, pressure=MemoryPressure.WARNING)
    assert policy.under_pressure() is True
    assert (events[-1].kind, events[-1].reason) == (
        DecisionKind.SPILL,
        "spilling episodic memory to disk: memory pressure warning",
    )
    memory.snap = replace(memory.snap, pressure=MemoryPressure.CRITICAL)
    assert policy.under_pressure() is True and len(events) == 1  # still spilling: no repeat
    memory.snap = replace(memory.snap, pressure=MemoryPressure.NORMAL)
    assert policy.under_pressure() is False and events[-1].kind is DecisionKind.KEEP


def test_budget_and_episodic_sizing() -> None:
    policy, *_ = make()
    assert policy.budget_bytes() == int(16 * GB * 0.6)
    # budget 9.6 GB - 4 GB weights - 0.6 GB working KV = 5 GB spare, half of it episodic
    assert policy.episodic_budget_bytes(4 * GB, int(0.6 * GB)) == int(
        (int(16 * GB * 0.6) - 4 * GB - int(0.6 * GB)) * 0.5
    )
    assert policy.episodic_budget_bytes(20 * GB, 0) == 0
    explicit, *_ = make(budget_bytes=8 * GB, episodic_share=0.25)
    assert explicit.episodic_budget_bytes(2 * GB, 2 * GB) == 1 * GB


def test_check_model_fits() -> None:
    policy, _thermal, memory, *_ = make()
    policy.check_model_fits(4 * GB, 1 * GB)  # 5 GB of min(9.6 GB budget, 10 GB available): fits
    memory.snap = replace(memory.snap, available_bytes=3 * GB)
    with pytest.raises(InsufficientMemory) as err:
        policy.check_model_fits(4 * GB, 1 * GB)
    assert isinstance(err.value, SparkError)
    message = str(err.value)
    assert message.startswith("This model needs 5.0 GB (4.0 GB of weights and 1.0 GB of KV cache) but only 3.0 GB")
    assert "\n" not in message and message.endswith("close other apps or choose a smaller model.")


def test_listeners_can_unsubscribe() -> None:
    policy, thermal, *_ = make()
    got: list[PolicyDecision] = []
    unsubscribe = policy.subscribe(got.append)
    unsubscribe()
    thermal.state = S
    policy.refresh()
    assert got == []
