"""Fit the plant model (``raytrain_scu.core.plant``) to the GPU study's traces and report its error.

    python -m raytrain_scu.studies.control.fit_plant docs/ablation/results.json --out docs/control/plant_fit.json

Method (docs/control.md):

- Runs: every trial whose prior is the spec's (zero-centred): the fixed-λ grid, ``none``, the SCU arms, the gain
  grid and the tuned gains. The update-centred arms penalise w − w_init, another plant, and are left out.
- Open-loop replay: each run's logged λ_applied and the loop's learning rate at each step drive the model from the
  run's first ParamBPT; the model predicts every later ParamBPT (and its A and B parts) and DataBPT. Seeds differ
  in N (tokens per epoch), so a run's ParamBPT scale and its penalty per λ are scaled by c = its first ParamBPT / 65.
- ParamBPT loss: rms over steps of ln max(P, 1e-3) (model against trace), plus a quarter of the same for each
  part. Below 1e-3 bits/token (S < 2e-4) Adam's ε and bf16 shape the tail, which the model does not describe and
  no target comes near. Nelder-Mead from a start read off the traces (A's shrink rate 1/22 per step, ...).
- Fit on seeds 0 and 1; seed 3 is held out and reported apart. The one-state slew model
  (Δln P = ℓ·clip((a − b·ln λ − ln P)/τ, −s_d, s_u)) is fitted the same way, as the baseline, on the same runs
  less ``none`` (λ = 0 has no ln λ); its error is still reported on every run.
- DataBPT: D0 is each run's mean DataBPT over its first 5 steps (the bare base model); δ's three constants are
  fitted by least squares on the fit seeds through the model's predicted B norm; the noise is the standard
  deviation of DataBPT in the λ = 1000 runs (no adapter left to learn anything), fit seeds only.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

from raytrain_scu.core.plant import LR_REF, norms_step
from raytrain_scu.core.schedule import lr_factors

FLOOR = 1e-3  # bits/token: ln P is compared above this
R_REF = 65.0  # A's init part at the reference N (the study's seeds: 57-74)
FIT_SEEDS, HELD_OUT_SEEDS = (0, 1), (3,)
# the fitted constants of core.plant, in the order of the optimiser's vector (log-scaled where marked)
NAMES = ("feature_remnant", "fit_scale", "fit_power", "penalty_scale", "speed_b", "speed_a", "grad_noise",
         "remnant_rate", "remnant_noise", "a_init", "tail_rate")
LOGGED = {"fit_scale", "penalty_scale", "speed_b", "speed_a", "grad_noise", "remnant_rate", "remnant_noise",
          "a_init", "tail_rate"}
START = {"feature_remnant": 0.3, "fit_scale": 0.7, "fit_power": 0.7, "penalty_scale": 0.1, "speed_b": 0.3,
         "speed_a": 0.2, "grad_noise": 0.05, "remnant_rate": 1 / 22, "remnant_noise": 0.1, "a_init": 0.03,
         "tail_rate": 0.3}


def load_runs(path: str) -> list[dict]:
    """The zero-centred runs of the study: per step (1..T) λ_applied, ParamBPT and its parts, DataBPT."""
    doc = json.loads(Path(path).read_text())
    runs = []
    for stage in doc["stages"].values():
        for t in stage.get("trials", []):
            if t.get("prior_center", "zero") != "zero":
                continue
            h = t["history"]
            col = {k: np.array([np.nan if v is None else v for v in h[k][1:]], float)
                   for k in ("ctrl/lambda_applied", "train/param_bpt", "train/param_bpt_a", "train/param_bpt_b",
                             "train/data_bpt")}
            runs.append({"name": _name(t), "family": t["family"], "seed": int(t["seed"]),
                         "lam": col["ctrl/lambda_applied"], "P": col["train/param_bpt"],
                         "PA": col["train/param_bpt_a"], "PB": col["train/param_bpt_b"], "D": col["train/data_bpt"]})
    return runs


def _name(t: dict) -> str:
    p = t["params"]
    if t["family"] in ("fixed", "none"):
        return f"{t['family']} λ={p.get('controller.lambda_init', 0)} seed {t['seed']}"
    return f"{t['family']} S*={t['target_s']} Kp={t['kp']:.3g} Ki={t['ki']:.3g} seed {t['seed']}"


def params_of(x) -> dict:
    """The optimiser's vector (or a (K, n) stack of them) as core.plant's constants."""
    x = np.asarray(x, float)
    cols = x.T if x.ndim == 1 else x.T[:, :, None]
    return {n: (np.exp(v) if n in LOGGED else v) for n, v in zip(NAMES, cols)}


def replay(p: dict, runs: list[dict], steps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Open loop: ParamBPT's A and B parts and the B norm per run and step, driven by each run's logged λ."""
    ell = np.array(lr_factors(steps)) * (2e-3 / LR_REF)
    c = np.array([r["P"][0] / R_REF for r in runs])
    lam = np.nan_to_num(np.array([r["lam"][:steps] for r in runs])) * c[:, None]
    shape = np.broadcast_shapes(np.shape(p["a_init"]), (len(runs),))
    rho, a, b = np.ones(shape), np.broadcast_to(p["a_init"], shape).copy(), np.zeros(shape)
    pa, pb, bn = (np.empty(shape + (steps,)) for _ in range(3))
    for t in range(steps):
        pa[..., t], pb[..., t], bn[..., t] = c * (R_REF * rho ** 3 + a * a), c * b * b, b
        rho, a, b = norms_step(rho, a, b, R_REF, lam[:, t], ell[t], p, power=p["fit_power"])
    return pa, pb, bn


def log_rms(model, trace) -> np.ndarray:
    """rms over steps of ln max(·, FLOOR), per run (last axis = steps)."""
    d = np.log(np.maximum(model, FLOOR)) - np.log(np.maximum(np.nan_to_num(trace), FLOOR))
    return np.sqrt(np.mean(d * d, axis=-1))


def loss(x, runs, steps) -> float:
    with np.errstate(all="ignore"):
        pa, pb, _ = replay(params_of(x), runs, steps)
        e, ea, eb = (log_rms(m, np.array([r[k] for r in runs])) for m, k in ((pa + pb, "P"), (pa, "PA"), (pb, "PB")))
        v = _rms(e) + 0.25 * (_rms(ea) + _rms(eb))
    return v if math.isfinite(v) else 1e9


def _rms(e) -> float:
    return float(np.sqrt(np.mean(np.square(e))))


def nelder_mead(f, x0, step: float = 0.3, iters: int = 1500) -> tuple[np.ndarray, float]:
    """Plain Nelder-Mead (reflect 1, expand 2, contract ½, shrink ½), from x0 with a simplex of ``step``."""
    pts = [np.array(x0, float)] + [np.array(x0, float) + step * e for e in np.eye(len(x0))]
    vals = [f(p) for p in pts]
    for it in range(iters):
        order = np.argsort(vals)
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        if it > 50 and vals[-1] - vals[0] < 1e-9 * (1 + abs(vals[0])):
            break
        centre = np.mean(pts[:-1], axis=0)
        xr = centre + (centre - pts[-1]); fr = f(xr)
        if fr < vals[0]:
            xe = centre + 2 * (centre - pts[-1]); fe = f(xe)
            pts[-1], vals[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = xr, fr
        else:
            xc = centre + 0.5 * (pts[-1] - centre); fc = f(xc)
            if fc < vals[-1]:
                pts[-1], vals[-1] = xc, fc
            else:
                pts = [pts[0]] + [pts[0] + 0.5 * (q - pts[0]) for q in pts[1:]]
                vals = [vals[0]] + [f(q) for q in pts[1:]]
    best = int(np.argmin(vals))
    return pts[best], vals[best]


def fit_data_model(runs, bnorm, steps) -> dict:
    """DataBPT's drop δ = g_D·ln(1 + b²/s_D) + μ·Σℓ·b², least squares on the fit seeds by a log-grid then
    Nelder-Mead (three constants); the noise from the λ = 1000 runs."""
    ell = np.array(lr_factors(steps))
    d0 = np.array([np.nanmean(r["D"][:5]) for r in runs])
    dd = np.array([r["D"][:steps] for r in runs])
    b2 = bnorm ** 2
    memo = np.concatenate([np.zeros((len(runs), 1)), np.cumsum(ell[:-1] * b2[:, :-1], axis=1)], axis=1)

    def pred(y):
        g, s, mu = np.exp(y)
        return np.maximum(d0[:, None] - g * np.log1p(b2 / s) - mu * memo, 0.03)

    fit = [i for i, r in enumerate(runs) if r["seed"] in FIT_SEEDS]
    y, _ = nelder_mead(lambda y: float(np.nanmean((pred(y)[fit] - dd[fit]) ** 2)), np.log([0.1, 0.1, 2e-4]), 0.5)
    noise = [np.nanstd(r["D"]) for r in runs if r["family"] == "fixed" and r["seed"] in FIT_SEEDS
             and r["lam"][0] == 1000.0]
    g, s, mu = (float(v) for v in np.exp(y))
    return {"drop_scale": g, "drop_knee": s, "memorise": mu, "noise": float(np.mean(noise)),
            "data_bpt0": float(np.mean(d0)), "_pred": pred(y), "_d": dd}


def baseline_replay(x, runs, steps) -> np.ndarray:
    """The one-state slew model (the baseline): Δln P = ℓ·clip((a − b·ln λ − ln P)/τ, −s_d, s_u), from the run's
    first ParamBPT; λ = 0 (``none``) is taken as 1e-6."""
    a, b, log_tau, s_d, s_u = x
    ell = np.array(lr_factors(steps))
    lam = np.maximum(np.nan_to_num(np.array([r["lam"][:steps] for r in runs])), 1e-6)
    lnp = np.log(np.array([r["P"][0] for r in runs]))
    out = np.empty((len(runs), steps))
    for t in range(steps):
        out[:, t] = lnp
        lnp = lnp + ell[t] * np.clip((a - b * np.log(lam[:, t]) - lnp) / math.exp(log_tau), -s_d, s_u)
    return np.exp(out)


def report(runs, p_model, d_model, base_model, steps) -> dict:
    """Per run, per family and overall: rms of ln P (and of its parts) for the model and the baseline, and of
    DataBPT for the model; 'fit' and 'held_out' pool the fit and the held-out seeds, 'penalised_*' the same without
    the λ = 0 runs."""
    pa, pb, _ = p_model
    rows = []
    for i, r in enumerate(runs):
        rows.append({"run": r["name"], "family": r["family"], "seed": r["seed"],
                     "held_out": r["seed"] in HELD_OUT_SEEDS,
                     "ln_p_rms": float(log_rms(pa[i] + pb[i], r["P"][:steps])),
                     "ln_pa_rms": float(log_rms(pa[i], r["PA"][:steps])),
                     "ln_pb_rms": float(log_rms(pb[i], r["PB"][:steps])),
                     "baseline_ln_p_rms": float(log_rms(base_model[i], r["P"][:steps])),
                     "data_bpt_rms": float(np.sqrt(np.nanmean((d_model["_pred"][i] - d_model["_d"][i]) ** 2)))})

    def pool(sel):
        keys = ("ln_p_rms", "ln_pa_rms", "ln_pb_rms", "baseline_ln_p_rms", "data_bpt_rms")
        return {k: _rms([row[k] for row in sel]) for k in keys} | {"runs": len(sel)}

    families = sorted({row["family"] for row in rows})
    penalised = [x for x in rows if x["family"] != "none"]  # the runs the baseline can describe
    return {"fit": pool([x for x in rows if not x["held_out"]]), "held_out": pool([x for x in rows if x["held_out"]]),
            "all": pool(rows), "penalised_fit": pool([x for x in penalised if not x["held_out"]]),
            "penalised_held_out": pool([x for x in penalised if x["held_out"]]),
            "by_family": {f: pool([x for x in rows if x["family"] == f]) for f in families}, "runs": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m raytrain_scu.studies.control.fit_plant",
                                 description="Fit core.plant to the GPU study's traces (open-loop replay).")
    ap.add_argument("results", help="the study's results.json (docs/ablation/results.json)")
    ap.add_argument("--out", required=True, help="where the fit and its error table go (JSON)")
    ap.add_argument("--restarts", type=int, default=5, help="Nelder-Mead restarts from the last best")
    ap.add_argument("--iters", type=int, default=1500, help="Nelder-Mead iterations per restart")
    args = ap.parse_args(argv)
    runs = load_runs(args.results)
    steps = min(len(r["P"]) for r in runs)
    fit_runs = [r for r in runs if r["seed"] in FIT_SEEDS]
    x = np.array([math.log(START[n]) if n in LOGGED else START[n] for n in NAMES])
    value = loss(x, fit_runs, steps)
    for k in range(args.restarts):
        x, value = nelder_mead(lambda y: loss(y, fit_runs, steps), x, 0.3, args.iters)
        print(f"restart {k}: loss {value:.4f}", file=sys.stderr, flush=True)
    p = {n: float(v) for n, v in params_of(x).items()}
    with np.errstate(all="ignore"):
        p_model = replay(p, runs, steps)
    d_model = fit_data_model(runs, p_model[2], steps)
    penalised = [r for r in fit_runs if r["family"] != "none"]  # the baseline has no equilibrium at λ = 0
    xb = np.array([-2.0, 0.94, math.log(3.8), 0.164, 0.083])  # b, τ and clips as first proposed for it
    for _ in range(max(1, args.restarts)):
        xb, _v = nelder_mead(lambda y: _rms(log_rms(baseline_replay(y, penalised, steps),
                                                    np.array([r["P"][:steps] for r in penalised]))), xb, 0.2, args.iters)
    table = report(runs, p_model, d_model, baseline_replay(xb, runs, steps), steps)
    fitted = {"remnant_init": R_REF} | p | {k: v for k, v in d_model.items() if not k.startswith("_")}
    fitted["data_floor"] = 0.03
    out = {"method": __doc__.split("Method (docs/control.md):")[1].strip(), "floor_bits": FLOOR,
           "fit_seeds": list(FIT_SEEDS), "held_out_seeds": list(HELD_OUT_SEEDS), "loss": value,
           "fitted": fitted, "baseline": dict(zip(("a", "b", "log_tau", "s_down", "s_up"), map(float, xb))),
           "error": table}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    e = table
    pf, ph = e["penalised_fit"], e["penalised_held_out"]
    print(f"ln P rms: fit {e['fit']['ln_p_rms']:.3f}, held out {e['held_out']['ln_p_rms']:.3f}; without λ = 0 "
          f"{pf['ln_p_rms']:.3f} / {ph['ln_p_rms']:.3f} (baseline {pf['baseline_ln_p_rms']:.3f} / "
          f"{ph['baseline_ln_p_rms']:.3f}); "
          f"DataBPT rms {e['all']['data_bpt_rms']:.3f} bits")
    return 0


if __name__ == "__main__":
    sys.exit(main())
