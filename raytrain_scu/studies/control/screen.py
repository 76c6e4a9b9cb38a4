"""Screen control laws on the fitted plant model and on perturbed plants; write the table docs/control.md quotes.

    python -m raytrain_scu.studies.control.screen --out docs/control/screen.json

Every arm runs at S* = 0.137 / 0.241 / 0.388 (the GPU study's targets) on every plant of ``PLANTS`` and every noise
seed, with the GPU study's settings: λ in [1e-4, 1e3] from λ = 1, AdamW lr 2e-3 with 20 warm-up steps and cosine
to 0.1×, 300 steps, σ = 0.01 and N = the study's (the model's ParamBPT scale). A run passes when it settles on Ŝ
(``core.settling``) by 2/3 of its steps and λ meets no bound after step 60. The arms are the spec's law (default
and tuned gains), the earlier leads as laws (integral-only on the log-odds error, with and without the
learning-rate scaling) and the logodds law without and with its slew-aware hold; ``logodds`` is the chosen one
with its defaults. ``--grid`` adds a gain grid of the logodds law, from which its defaults were chosen.
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

from raytrain_scu.config.schema import ControllerConfig
from raytrain_scu.core.controller import SCUController
from raytrain_scu.core.laws import LogOddsController
from raytrain_scu.core.plant import FITTED, Plant, simulate
from raytrain_scu.core.settling import summary

TARGETS = (0.137, 0.241, 0.388)
SEEDS = (0, 1)
V1 = {"lambda_min": 1e-4, "lambda_max": 1e3}  # experiments/ablation-gpu.yaml
BOUND_AFTER = 60  # λ at a bound after this step fails a run
_P = Plant()
# name -> (plant, simulate keywords): the fit, a structurally different model, and one knob turned at a time
PLANTS = {
    "fitted": (_P, {}),
    "first-order model": (_P.with_(kind="first_order"), {}),
    "gain x0.5": (_P.with_(gain=0.5), {}),
    "gain x2": (_P.with_(gain=2.0), {}),
    "lag 5 steps": (_P.with_(lag=5.0), {}),
    "lag 10 steps": (_P.with_(lag=10.0), {}),
    "noise x2": (_P.with_(noise=2 * FITTED["noise"]), {}),
    "speed x0.5": (_P.with_(speed=0.5), {}),
    "speed x2": (_P.with_(speed=2.0), {}),
    "fast near S* (grad noise /4)": (_P.with_(params=FITTED | {"grad_noise": FITTED["grad_noise"] / 4}), {}),
    "A init x4": (_P.with_(init_scale=4.0), {}),
    "LoRA r64 (init x4, speed x2)": (_P.with_(init_scale=4.0, speed=2.0), {}),
    "N x4 (ParamBPT /4)": (_P.with_(p_scale=0.25), {}),
    "N /4 (ParamBPT x4)": (_P.with_(p_scale=4.0), {}),
    "lr 5e-4": (_P, {"lr": 5e-4}),
    "1000 steps": (_P, {"steps": 1000}),
    "lr 5e-4, 1000 steps": (_P, {"lr": 5e-4, "steps": 1000}),
}

# beyond the pass rule: harsher knobs, run for the spec's law and the chosen defaults only (a robustness margin)
STRESS = {
    "lag 20 steps": (_P.with_(lag=20.0), {}),
    "gain x3": (_P.with_(gain=3.0), {}),
    "gain x0.33": (_P.with_(gain=1 / 3), {}),
    "speed x4": (_P.with_(speed=4.0), {}),
    "speed x0.25": (_P.with_(speed=0.25), {}),
    "grad noise /10": (_P.with_(params=FITTED | {"grad_noise": FITTED["grad_noise"] / 10}), {}),
    "grad noise x3": (_P.with_(params=FITTED | {"grad_noise": FITTED["grad_noise"] * 3}), {}),
    "first-order model, speed x4": (_P.with_(kind="first_order", speed=4.0), {}),
    "noise x4": (_P.with_(noise=4 * FITTED["noise"]), {}),
    "lr 2.5e-4": (_P, {"lr": 2.5e-4}),
    "lr 5e-4, LoRA r64": (_P.with_(init_scale=4.0, speed=2.0), {"lr": 5e-4}),
    "lr 5e-4, LoRA r64, 600 steps": (_P.with_(init_scale=4.0, speed=2.0), {"lr": 5e-4, "steps": 600}),
    "lr 5e-4, 600 steps": (_P, {"lr": 5e-4, "steps": 600}),
}


class NoLrFactor:
    """A law with the learning-rate scaling switched off: it never sees ``lr_factor``."""

    takes_lr_factor = False

    def __init__(self, law):
        self.law = law

    def __getattr__(self, name):
        return getattr(self.law, name)

    def update(self, data_bpt, param_bpt, step=None):
        return self.law.update(data_bpt, param_bpt, step=step)


def logodds(target_s: float, **overrides):
    """The logodds law at ``target_s`` with the config's defaults, some overridden (keyword = constructor's)."""
    c = ControllerConfig()
    kw = {"kp": c.logodds_kp, "ki": c.logodds_ki, "data_alpha": c.logodds_data_alpha,
          "max_error": c.logodds_max_error, "max_step": c.logodds_max_step, "hold_error": c.logodds_hold_error}
    return LogOddsController(target_s=target_s, lambda_init=c.lambda_init, **V1, **(kw | overrides))


NO_HOLD = {"hold_error": 1e9}
LOOSE = {"max_error": 50.0, "max_step": 50.0}  # neither clip acts
ARMS = {
    "spec (Kp 0.8, Ki 0.15)": lambda t: SCUController(target_s=t, **V1),
    "spec tuned (Kp 0.455, Ki 0.0151)": lambda t: SCUController(target_s=t, kp=0.455, ki=0.0151, **V1),
    "lead: I-only log-odds k 0.04": lambda t: NoLrFactor(logodds(t, kp=0.0, ki=0.04, **NO_HOLD, **LOOSE)),
    "lead: I-only log-odds k 0.04 x lr": lambda t: logodds(t, kp=0.0, ki=0.04, **NO_HOLD, **LOOSE),
    "logodds without hold": lambda t: logodds(t, **NO_HOLD),
    "logodds without lr scaling": lambda t: NoLrFactor(logodds(t)),
    "logodds without error clip": lambda t: logodds(t, max_error=50.0),
    "logodds (defaults)": lambda t: logodds(t),
}


def run_arm(make, plants=PLANTS, targets=TARGETS, seeds=SEEDS) -> list[dict]:
    """Every plant x target x seed of one arm: the settling summary of each run, and whether it passes."""
    rows = []
    for (name, (plant, kw)), target, seed in itertools.product(plants.items(), targets, seeds):
        kw = dict(kw)
        steps = kw.pop("steps", 300)
        out = simulate(make(target), plant, steps, seed=seed, **kw)
        row = summary(out["s"], out["s_hat"], out["lam"], target, V1["lambda_min"], V1["lambda_max"], out["step"])
        bound_late = row["last_bound_step"] is not None and row["last_bound_step"] > BOUND_AFTER
        row |= {"plant": name, "target": target, "seed": seed, "steps": steps,
                "passes": row["settled_step"] is not None and row["settled_step"] <= steps * 2 // 3 and not bound_late}
        rows.append(row)
    return rows


def aggregate(rows: list[dict]) -> dict:
    """One arm's headline: passes, settled (Ŝ, raw S), settled step (median, worst), second-half error, reversals,
    steps at a bound, and the plants with a failing run."""
    settled = [r["settled_step"] for r in rows if r["settled_step"] is not None]
    return {"runs": len(rows), "passes": sum(r["passes"] for r in rows), "settled": len(settled),
            "settled_raw": sum(r["settled_step_raw"] is not None for r in rows),
            "settled_step_median": statistics.median(settled) if settled else None,
            "settled_step_max": max(settled) if settled else None,
            "second_half_error": statistics.fmean(r["second_half_error"] for r in rows),
            "reversals": statistics.fmean(r["reversals"] for r in rows),
            "steps_at_bound": statistics.fmean(r["steps_at_bound"] for r in rows),
            "failing": sorted({f"{r['plant']} @ {r['target']}" for r in rows if not r["passes"]})}


def grid_arms() -> dict:
    """The logodds law's grid (Kp x Ki x e_hold x e_max) the defaults were chosen from."""
    arms = {}
    for kp, ki, hold, clip in itertools.product((1.0, 2.0, 3.0), (0.1, 0.2, 0.4), (0.5, 1.0, 2.0), (1.0, 2.0, 3.0)):
        arms[f"grid Kp {kp} Ki {ki} e_hold {hold} e_max {clip}"] = (lambda k, i, h, m: lambda t: logodds(
            t, kp=k, ki=i, hold_error=h, max_error=m))(kp, ki, hold, clip)
    return arms


def table(results: dict) -> str:
    """The arms as a markdown table."""
    lines = ["| arm | passes | settled on Ŝ | settled on raw S | settled step (median / worst) | mean abs(Ŝ − S*), "
             "2nd half | λ reversals | steps at a bound |", "|---|---|---|---|---|---|---|---|"]
    for name, a in results.items():
        med = "-" if a["settled_step_median"] is None else f"{a['settled_step_median']:.0f} / {a['settled_step_max']}"
        lines.append(f"| {name} | {a['passes']}/{a['runs']} | {a['settled']} | {a['settled_raw']} | {med} | "
                     f"{a['second_half_error']:.4f} | {a['reversals']:.2f} | {a['steps_at_bound']:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m raytrain_scu.studies.control.screen", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="the screen's JSON (per run and per arm)")
    ap.add_argument("--grid", action="store_true", help="also the logodds law's gain grid (slow: ~100 arms)")
    args = ap.parse_args(argv)
    arms = ARMS | (grid_arms() if args.grid else {})
    runs, results = {}, {}
    for name, make in arms.items():
        runs[name] = run_arm(make)
        results[name] = aggregate(runs[name])
        print(f"{name}: {results[name]['passes']}/{results[name]['runs']}", file=sys.stderr, flush=True)
    stress = {name: run_arm(ARMS[name], plants=STRESS, seeds=(0,))
              for name in ("spec (Kp 0.8, Ki 0.15)", "logodds (defaults)")}
    doc = {"plants": list(PLANTS), "targets": TARGETS, "seeds": SEEDS, "settings": V1 | {"lambda_init": 1.0},
           "pass_rule": f"settled on Ŝ by 2/3 of the steps and no λ bound after step {BOUND_AFTER}",
           "arms": results, "runs": {k: v for k, v in runs.items() if k in ARMS},  # the grid: aggregates only
           "stress": {k: aggregate(v) for k, v in stress.items()}, "stress_runs": stress}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(table({k: v for k, v in results.items() if k in ARMS}))
    print(table({f"{k}, stress plants": aggregate(v) for k, v in stress.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
