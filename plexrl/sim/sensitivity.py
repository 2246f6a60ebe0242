"""How far each uncertain constant moves the headline: the scenario rerun (baselines tuned again) with one
knob moved at a time, and the on-policy saving at matched step time compared with the shipped one.

The knobs are the constants the issue names as least certain: the generation cap (`max_tokens`), the
length distribution's shape (`sigma`), the colocated switch's fixed cost, and the training MFU; plus the
host link, which prices every offload and swap. `benchmarks/sim_sensitivity.py` prints the table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from plexrl.sim.config import Scenario
from plexrl.sim.deploy import DeploymentResult, StepTable
from plexrl.sim.scenario import ScenarioResult, run_one


def _work(sc: Scenario, **resp: float) -> Scenario:
    response = sc.workload.response.model_copy(update=resp)
    return sc.model_copy(update={"workload": sc.workload.model_copy(update={"response": response})})


def _eff(sc: Scenario, **changes: float) -> Scenario:
    return sc.model_copy(update={"efficiency": sc.efficiency.model_copy(update=changes)})


def _lora(sc: Scenario, scale: float) -> Scenario:
    if sc.lora is None:
        raise ValueError(f"{sc.name}: the decode_overhead knobs need a LoRA scenario (lora: in its YAML)")
    lora = sc.lora.model_copy(update={"decode_overhead": sc.lora.decode_overhead * scale})
    return sc.model_copy(update={"lora": lora})


KNOBS: dict[str, Callable[[Scenario], Scenario]] = {
    "max_tokens x0.5": lambda sc: _work(sc, max_tokens=sc.workload.response.max_tokens // 2),
    "max_tokens x1.5": lambda sc: _work(sc, max_tokens=int(sc.workload.response.max_tokens * 1.5)),
    "sigma -0.2": lambda sc: _work(sc, sigma=max(0.0, sc.workload.response.sigma - 0.2)),
    "sigma +0.2": lambda sc: _work(sc, sigma=sc.workload.response.sigma + 0.2),
    "switch_fixed_s x0.25": lambda sc: _eff(sc, switch_fixed_s=sc.efficiency.switch_fixed_s / 4),
    "switch_fixed_s x4": lambda sc: _eff(sc, switch_fixed_s=sc.efficiency.switch_fixed_s * 4),
    "train_mfu x0.75": lambda sc: _eff(sc, train_mfu=sc.efficiency.train_mfu * 0.75),
    "train_mfu x1.25": lambda sc: _eff(sc, train_mfu=min(1.0, sc.efficiency.train_mfu * 1.25)),
    "host_gbps x0.5": lambda sc: sc.model_copy(
        update={"accelerator": sc.accelerator.model_copy(update={"host_gbps": sc.accelerator.host_gbps / 2})}
    ),
    "decode_overhead x0.4": lambda sc: _lora(sc, 0.4),  # LoRA scenarios: adapters applied unmerged
    "decode_overhead x2": lambda sc: _lora(sc, 2.0),
}


@dataclass(frozen=True, slots=True)
class Band:
    knob: str
    strongest: str  # the strongest baseline and its layout
    best: str  # the on-policy PlexRL row at matched step time ("" if none)
    saving: float | None  # its saving vs the strongest baseline
    best_any: str  # the cheapest PlexRL row at any step time, on- or off-policy
    saving_any: float
    step_any: float  # its step time / the strongest baseline's


def headline_band(sc: Scenario, knob: str = "shipped") -> Band:
    tables: dict[object, StepTable] = {}
    results: list[DeploymentResult] = [run_one(sc, d, tables=tables) for d in sc.deployments]
    res = ScenarioResult(sc, results)
    base = res.strongest()
    best = res.headline()
    plex = [r for r in results if r.kind.startswith("plexrl")]
    cheap = min(plex, key=lambda r: r.gpu_hours_per_step)
    return Band(
        knob, f"{base.name} {base.layout}", best.name if best else "", res.saving(best, base) if best else None,
        cheap.name, res.saving(cheap, base), cheap.step_seconds / base.step_seconds,
    )  # fmt: skip


def sensitivity(sc: Scenario, knobs: list[str] | None = None) -> list[Band]:
    """The shipped headline, then one band per knob (all of `KNOBS` that apply by default)."""
    names = [k for k in KNOBS if sc.lora or not k.startswith("decode_overhead")] if knobs is None else knobs
    unknown = [k for k in names if k not in KNOBS]
    if unknown:
        raise ValueError(f"unknown sensitivity knobs {unknown}; known: {sorted(KNOBS)}")
    return [headline_band(sc)] + [headline_band(KNOBS[k](sc), k) for k in names]


def format_bands(sc: Scenario, bands: list[Band]) -> str:
    ref = bands[0].saving
    lines = [
        f"{sc.name}: on-policy saving at <= {sc.matched_step:g}x the strongest baseline's step, one knob at a time",
        f"{'knob':<22}{'strongest baseline':<28}{'headline row':<18}{'saving':>8}{'moves':>8}"
        f"  {'cheapest PlexRL (any step)'}",
    ]
    for b in bands:
        got = "" if b.saving is None else f"{b.saving:+.1%}"
        moved = "" if b.saving is None or ref is None else f"{(b.saving - ref) * 100:+.1f}pp"
        any_ = f"{b.best_any} {b.saving_any:+.1%} at {b.step_any:.2f}x"
        lines.append(f"{b.knob:<22}{b.strongest:<28}{b.best or '(none)':<18}{got:>8}{moved:>8}  {any_}")
    return "\n".join(lines)
