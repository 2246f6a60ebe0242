"""The llm-d / OpenRL figures the multiplexing benchmarks print for each arm (`benchmarks/_arms.py`), from spans."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from _arms import curve, hand_overs, phase_waits, same_curve

from plexrl.hooks.timeline import Span

# a: rollout [svc] -> verify [cpu] -> train [svc]; train -> evaluate [svc] (the same phase as train)
PLAN = {
    "rollout": ("service", ()),
    "verify": ("cpu", ("rollout",)),
    "train": ("service", ("verify",)),
    "evaluate": ("service", ("train",)),
}


def test_hand_overs_count_the_blocking_switch_and_the_gap_between_jobs() -> None:
    spans = [
        Span("a", 0, "rollout", "service-0", 0.0, 1.0),
        Span("b", 0, "swap", "service-0", 1.1, 1.5, "swap", 100),  # b's state in (a's out), before b's node
        Span("b", 0, "rollout", "service-0", 1.5, 2.5),
        Span("b", 0, "train", "service-0", 2.5, 3.0),  # b again: no hand-over
        Span("a", 0, "verify", "cpu", 1.0, 2.0),
        Span("a", 0, "train", "service-0", 3.2, 4.0),  # a's state was prefetched: no swap, a 0.2 s gap
    ]
    assert [(round(s, 6), round(g, 6)) for s, g in hand_overs(spans)] == [(0.4, 0.5), (0.0, 0.2)]


def test_a_phase_waits_from_its_ready_time_to_its_swap_and_continued_nodes_are_not_phases() -> None:
    spans = [
        Span("a", 0, "rollout", "service-0", 0.5, 1.0),  # a source node: ready at the job's first span
        Span("a", 0, "verify", "cpu", 1.0, 2.0),
        Span("a", 0, "swap", "service-0", 2.6, 3.0, "swap", 10),
        Span("a", 0, "train", "service-0", 3.0, 4.0),  # ready at 2.0 (verify's end), its swap began at 2.6
        Span("a", 0, "evaluate", "service-0", 4.0, 4.5),  # continues train's phase: no wait of its own
        Span("a", 1, "rollout", "service-0", 5.0, 6.0),  # ready at 4.5 (iteration 0's last end)
    ]
    waits = phase_waits(spans, {"a": PLAN})
    assert sorted(round(w, 6) for w in waits) == [0.0, 0.5, 0.6]


def test_curves_drop_timing_keys_and_compare_nan_as_equal() -> None:
    rows = [{"loss": float("nan"), "time/rollout": 1.0, "rollout/tokens_per_s": 9.0, "reward": 0.5}]
    assert curve(rows) == [{"loss": rows[0]["loss"], "reward": 0.5}]
    assert same_curve(curve(rows), [{"loss": float("nan"), "reward": 0.5}])
    assert not same_curve(curve(rows), [{"loss": 0.0, "reward": 0.5}])
