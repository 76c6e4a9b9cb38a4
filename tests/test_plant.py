"""The plant model (core.plant) and the screen's verdicts on it: the spec's law limit-cycles as it did on the GPU, the
logodds law's defaults settle on every perturbed plant; the settled definition (core.settling) on hand-made traces."""
import json
import math
from pathlib import Path

import numpy as np
import pytest

from raytrain_scu.controller import SCUController
from raytrain_scu.core.plant import FITTED, FITTED_FIRST_ORDER, Plant, lr_factors, simulate
from raytrain_scu.core.schedule import lr_at
from raytrain_scu.core.settling import reversals, second_half_error, settled_from, summary
from raytrain_scu.studies.control import fit_plant, screen

ROOT = Path(__file__).resolve().parents[1]
TARGETS = (0.137, 0.241, 0.388)
V1 = {"lambda_min": 1e-4, "lambda_max": 1e3}


# --- the settled definition, on hand-made traces

def logistic(x):
    return 1 / (1 + math.exp(-x))


def test_settled_from_finds_the_earliest_step_that_holds_to_the_end():
    z = math.log(0.2 / 0.8)
    s = [logistic(z + 1.0)] * 50 + [logistic(z + 0.05)] * 150   # in the band from step 51
    lam = [1.0] * 200
    assert settled_from(s, lam, 0.2, 1e-4, 1e3) == 51
    assert settled_from(s, lam, 0.2, 1e-4, 1e3, steps=list(range(10, 210))) == 60
    assert settled_from(s[:140], lam[:140], 0.2, 1e-4, 1e3) is None     # 90 steps in the band: too short


def test_settled_needs_lambda_inside_its_bounds_and_within_a_factor_1_5():
    s = [0.2] * 200
    assert settled_from(s, [1e3] * 200, 0.2, 1e-4, 1e3) is None          # at the bound: not control
    lam = [1.0] * 60 + [1.0 + 0.004 * i for i in range(140)]              # 1.0 -> 1.556 over the last 140
    t = settled_from(s, lam, 0.2, 1e-4, 1e3)
    assert t is not None and max(lam[t - 1:]) / min(lam[t - 1:]) <= 1.5 < max(lam[t - 2:]) / min(lam[t - 2:])


def test_settled_band_is_in_log_odds():
    z = math.log(0.5 / 0.5)
    assert settled_from([logistic(z + 0.099)] * 120, [1.0] * 120, 0.5, 1e-4, 1e3) == 1
    assert settled_from([logistic(z - 0.101)] * 120, [1.0] * 120, 0.5, 1e-4, 1e3) is None


def test_reversals_count_only_swings_of_half_a_unit_in_ln_lambda():
    wiggle = [math.exp(0.2 * math.sin(i / 3)) for i in range(200)]  # peak to peak 0.4 < 0.5
    assert reversals(wiggle) == 0
    assert reversals([math.exp(0.3 * math.sin(i / 3)) for i in range(200)]) >= 15  # 0.6: every swing counts
    swing = [math.exp(x) for x in [0, 1, 2, 1, 0, 1, 2, 3, 2.6]]             # up, down, up; the last dip is small
    assert reversals(swing) == 2
    assert reversals([1e-4, 1e3, 1e-4, 1e3]) == 2


def test_second_half_error_and_summary():
    s = [0.9] * 100 + [0.25] * 100
    assert second_half_error(s, 0.2) == pytest.approx(0.05)
    row = summary(s, s, [1e3] * 50 + [0.1] * 150, 0.2, 1e-4, 1e3)
    assert row["steps_at_bound"] == 50 and row["last_bound_step"] == 50 and row["settled_step"] is None


# --- the plant

def test_lr_factors_follow_the_loop_schedule():
    f = lr_factors(300, warmup_steps=20, min_lr_ratio=0.1)
    assert f[0] == pytest.approx(0.05) and f[19] == pytest.approx(1.0) and f[20] == pytest.approx(1.0)
    assert f[160] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 140 / 280)))
    assert f[-1] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 279 / 280)))


def test_the_schedule_warms_up_linearly_then_decays_by_a_cosine_to_its_floor_by_hand():
    import math

    f = lr_factors(120, warmup_steps=20, min_lr_ratio=0.1)
    assert len(f) == 120
    assert f[0] == pytest.approx(1 / 20) and f[9] == pytest.approx(10 / 20) and f[19] == pytest.approx(1.0)
    assert f[20] == pytest.approx(1.0)                                     # the peak, where the decay starts
    assert f[70] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))  # half way: 0.55
    assert f[119] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 99 / 100)))
    assert lr_at(200, lr=3e-4, warmup_steps=20, max_steps=120, min_lr_ratio=0.1) == pytest.approx(3e-5)  # the floor
    assert lr_at(70, lr=3e-4, warmup_steps=20, max_steps=120, min_lr_ratio=0.1) == pytest.approx(3e-4 * f[70])


def test_lambda_acts_as_a_switch_on_a_s_init_and_sets_the_level_at_equilibrium():
    fixed = {lam: SCUController(mode="fixed", lambda_init=lam) for lam in (0.1, 1.0, 10.0, 100.0)}
    runs = {lam: simulate(law, Plant(), 300) for lam, law in fixed.items()}
    a20 = [runs[lam]["param_bpt_a"][19] for lam in (1.0, 10.0, 100.0)]
    assert max(a20) / min(a20) < 1.2                     # the same collapse of A's init for λ = 1 .. 100
    assert runs[1.0]["param_bpt_b"][0] == 0.0            # B starts at zero
    end = [runs[lam]["param_bpt"][-1] for lam in (0.1, 1.0, 10.0)]
    assert end[0] > 5 * end[1] > 25 * end[2]             # and λ sets where it ends


def test_simulate_applies_the_previous_update_s_lambda():
    out = simulate(SCUController(target_s=0.2, **V1), Plant(), 50)
    assert out["lam_applied"][0] == 1.0 and out["lam_applied"][1:] == out["lam"][:-1]


def test_the_fit_script_replays_the_same_equations_as_the_plant():
    lam = np.geomspace(1e-3, 10, 120)
    run = {"lam": lam, "P": np.full(120, 65.0), "PA": lam, "PB": lam, "D": lam, "seed": 0}
    pa, pb, _ = fit_plant.replay(dict(FITTED), [run], 120)
    state = Plant().start(0)
    for t, f in enumerate(lr_factors(120)):
        assert sum(state.parts()) == pytest.approx(pa[0, t] + pb[0, t], rel=1e-9)
        state.advance(lam[t], 2e-3 * f)


def test_fitted_constants_are_the_committed_fit():
    doc = json.loads((ROOT / "docs" / "control" / "plant_fit.json").read_text())
    for key, value in FITTED.items():
        assert value == pytest.approx(doc["fitted"][key], rel=1e-3), key
    for key, value in FITTED_FIRST_ORDER.items():
        assert value == pytest.approx(doc["baseline"][key], rel=1e-2, abs=1e-2), key
    assert doc["error"]["held_out"]["ln_p_rms"] < doc["error"]["held_out"]["baseline_ln_p_rms"]


# --- the screen's verdicts

@pytest.mark.parametrize("target", TARGETS)
def test_spec_law_limit_cycles_on_the_fitted_plant(target):
    out = simulate(SCUController(target_s=target, **V1), Plant(), 300)
    lam = out["lam"]
    assert min(lam) == 1e-4 and max(lam) == 1e3          # both bounds, as on the GPU
    assert reversals(lam) >= 2
    assert settled_from(out["s_hat"], lam, target, **V1) is None


def test_logodds_defaults_settle_on_every_perturbed_plant():
    rows = screen.run_arm(screen.ARMS["logodds (defaults)"], seeds=(0,))
    failing = {(r["plant"], r["target"]) for r in rows if not r["passes"]}
    # the one cell the model predicts too slow (docs/control.md): a quarter of the learning rate, the lowest target
    assert failing == {("lr 5e-4", 0.137)}
    assert len(rows) == len(screen.PLANTS) * 3 and all(r["steps_at_bound"] == 0 for r in rows)
    assert max(r["settled_step"] for r in rows if r["steps"] == 300 and r["settled_step"]) <= 200
    slow = simulate(screen.logodds(0.137), Plant(), 300, lr=5e-4)
    z = math.log(0.137 / 0.863)
    assert abs(math.log(slow["s_hat"][-1] / (1 - slow["s_hat"][-1])) - z) < 0.25  # still closing at the end
