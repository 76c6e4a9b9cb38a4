"""The SCU law, step by step, on hand-worked numbers; properties; closed loop on a synthetic plant."""
import json
import math
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raytrain_scu.core.controller import SaturationWindow, SCUController, info_ratio


def make(**kw):
    return SCUController(**kw)


def test_defaults_match_spec():
    c = SCUController()
    assert (c.target_s, c.kp, c.ki, c.ema_alpha, c.deadband, c.leak, c.integral_limit) == \
        (0.01, 0.8, 0.15, 0.1, 0.002, 0.995, 0.2)
    assert (c.lam, c.lambda_min, c.lambda_max) == (1.0, 1e-4, 10.0)
    assert c.integral == 0.0 and c.s_hat == 0.0


def test_info_ratio_zero_denominator():
    assert info_ratio(0.0, 0.0) == 0.0
    assert info_ratio(3.0, 1.0) == 0.25


def test_first_update_hand_worked():
    c = make()
    lam = c.update(3.0, 0.06)
    s = 0.06 / 3.06
    e = s - 0.01                       # first update: Ŝ = S
    i = 0.15 * e                       # leak of 0 is 0, then integrate
    u = 0.8 * e + i
    assert c.s_hat == s
    assert c.integral == pytest.approx(i, abs=1e-15)
    assert lam == pytest.approx(math.exp(u), abs=1e-15)
    assert lam > 1.0                   # S above target -> λ grows


def test_ema_second_update():
    c = make()
    c.update(3.0, 0.06)
    s1 = 0.06 / 3.06
    c.update(3.0, 0.0)
    assert c.s_hat == pytest.approx(0.1 * 0.0 + 0.9 * s1, abs=1e-15)


def test_sign_of_response_below_target():
    c = make()
    lam = c.update(3.0, 0.003)         # S ~ 0.001 < 0.01
    assert lam < 1.0


def test_deadband_leaks_and_holds_lambda():
    c = make()
    c.update(3.0, 0.06)                # builds an integral
    i0, lam0 = c.integral, c.lam
    # drive Ŝ into the deadband: set state so next EMA lands on target
    sd = c.state_dict()
    sd["s_hat"] = 0.0105
    c.load_state_dict(sd)
    lam = c.update(1.0, 0.0105 / (1 - 0.0105))   # S = 0.0105 -> Ŝ = 0.0105, e = 0.0005 within deadband
    assert lam == lam0
    assert c.integral == pytest.approx(0.995 * i0, abs=1e-15)


def test_conditional_integration_at_upper_bound():
    c = make(lambda_init=10.0)
    c.update(3.0, 0.3)                 # e > 0 with λ at λmax: no integration, only leak (of 0)
    assert c.integral == 0.0
    assert c.lam == 10.0


def test_conditional_integration_at_lower_bound():
    c = make(lambda_init=1e-4 * 1.0000001, lambda_min=1e-4)
    c.update(3.0, 0.0)                 # S = 0 < target: e < 0, λ pushed to λmin
    assert c.lam == 1e-4
    i1 = c.integral
    c.update(3.0, 0.0)                 # now λ <= λmin and e < 0: integral only leaks
    assert c.integral == pytest.approx(0.995 * i1, abs=1e-18)


def test_integral_clamp():
    c = make(ki=10.0, lambda_max=1e9)
    c.update(1.0, 1.0)                 # S = 0.5, e = 0.49, Ki·e = 4.9 -> clamped to 0.2
    assert c.integral == 0.2
    c2 = make(ki=100.0, lambda_min=1e-12, lambda_init=1.0)   # e = -0.01, Ki·e = -1
    c2.update(1.0, 0.0)
    assert c2.integral == -0.2


def test_lambda_clamp():
    c = make(kp=100.0)
    assert c.update(1.0, 1.0) == 10.0
    c = make(kp=1000.0)                # e = -0.01, u = -10: exp(-10) < 1e-4
    assert c.update(1.0, 0.0) == 1e-4


@pytest.mark.parametrize("bad", [(float("nan"), 0.1), (1.0, float("inf")), (float("-inf"), 0.0)])
def test_non_finite_input_is_skipped(bad):
    c = make()
    c.update(3.0, 0.06)
    before = c.state_dict()
    lam = c.update(*bad)
    after = c.state_dict()
    assert lam == before["lam"]
    assert after["n_skipped"] == before["n_skipped"] + 1
    after["n_skipped"] = before["n_skipped"]
    assert after == before


def test_modes_fixed_and_none():
    f = make(mode="fixed", lambda_init=2.0)
    n = make(mode="none")
    for _ in range(20):
        assert f.update(3.0, 0.3) == 2.0
        assert n.update(3.0, 0.3) == 0.0
    assert f.s_hat == pytest.approx(0.3 / 3.3) and n.s_hat == pytest.approx(0.3 / 3.3)
    assert f.integral == 0.0 and n.integral == 0.0


def test_fixed_lambda_is_not_bound_by_the_law_s_clamp():
    assert make(mode="fixed", lambda_init=50.0).update(3.0, 0.3) == 50.0   # above lambda_max
    assert make(mode="fixed", lambda_init=1e-6).update(3.0, 0.3) == 1e-6   # below lambda_min
    with pytest.raises(ValueError, match="lambda_init"):
        make(mode="scu", lambda_init=50.0)
    with pytest.raises(ValueError, match="fixed lambda_init must be > 0"):
        make(mode="fixed", lambda_init=0.0)


def test_state_dict_is_json_and_mode_checked():
    c = make()
    c.update(3.0, 0.06)
    sd = json.loads(json.dumps(c.state_dict()))
    d = make()
    d.load_state_dict(sd)
    assert d.state_dict() == c.state_dict()
    with pytest.raises(ValueError, match="mode"):
        make(mode="fixed").load_state_dict(sd)


# ---------------------------------------------------------------- independent reference, 1e-12

def reference_trace(inputs, p):
    """A second, independent transcription of SCU_SPEC.md's law."""
    lam, I, shat, init, out = p["lambda_init"], 0.0, 0.0, False, []
    for db, pb in inputs:
        if not (math.isfinite(db) and math.isfinite(pb)):
            out.append((lam, I, shat))
            continue
        S = pb / (db + pb) if (db + pb) != 0 else 0.0
        shat = S if not init else p["ema_alpha"] * S + (1 - p["ema_alpha"]) * shat
        init = True
        e = shat - p["target_s"]
        if abs(e) <= p["deadband"]:
            I = p["leak"] * I
        else:
            I = p["leak"] * I
            if not ((lam <= p["lambda_min"] and e < 0) or (lam >= p["lambda_max"] and e > 0)):
                I = min(max(I + p["ki"] * e, -p["integral_limit"]), p["integral_limit"])
            lam = min(max(lam * math.exp(p["kp"] * e + I), p["lambda_min"]), p["lambda_max"])
        out.append((lam, I, shat))
    return out


finite = st.floats(min_value=0.0, max_value=20.0, allow_nan=False)
maybe_bad = st.one_of(finite, st.sampled_from([float("nan"), float("inf")]))
params = st.fixed_dictionaries({
    "target_s": st.floats(0.001, 0.5), "kp": st.floats(0.0, 3.0), "ki": st.floats(0.0, 1.0),
    "ema_alpha": st.floats(0.01, 1.0), "deadband": st.floats(0.0, 0.01), "leak": st.floats(0.9, 1.0),
    "integral_limit": st.floats(0.0, 1.0), "lambda_init": st.floats(0.001, 5.0),
    "lambda_min": st.just(1e-4), "lambda_max": st.just(10.0)})


@settings(max_examples=200, deadline=None)
@given(p=params, inputs=st.lists(st.tuples(maybe_bad, st.floats(0.0, 2.0)), min_size=1, max_size=60))
def test_agrees_with_independent_implementation(p, inputs):
    c = SCUController(**p)
    for (lam, I, shat), x in zip(reference_trace(inputs, p), inputs):
        c.update(*x)
        assert abs(c.lam - lam) <= 1e-12 and abs(c.integral - I) <= 1e-12 and abs(c.s_hat - shat) <= 1e-12
        # properties that always hold
        assert c.lambda_min <= c.lam <= c.lambda_max
        assert abs(c.integral) <= p["integral_limit"] + 1e-15


@settings(max_examples=100, deadline=None)
@given(db=st.floats(0.5, 5.0), excess=st.floats(0.01, 0.5), n=st.integers(1, 50))
def test_constant_s_above_target_never_decreases_lambda(db, excess, n):
    c = SCUController()
    s = 0.01 + 0.002 + excess                 # beyond the deadband
    pb = s * db / (1 - s)
    prev = c.lam
    for _ in range(n):
        lam = c.update(db, pb)
        assert lam >= prev
        prev = lam


@settings(max_examples=100, deadline=None)
@given(inputs=st.lists(st.tuples(finite, st.floats(0.0, 2.0)), min_size=2, max_size=40), cut=st.integers(0, 39))
def test_state_dict_round_trip_continues_identically(inputs, cut):
    cut = min(cut, len(inputs) - 1)
    a = SCUController(saturation_window=5)
    for x in inputs[:cut]:
        a.update(*x)
    b = SCUController(saturation_window=5)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    for x in inputs[cut:]:
        assert a.update(*x) == b.update(*x)
    assert a.state_dict() == b.state_dict()


# ---------------------------------------------------------------- closed loop

def plant_param_bpt(lam, w2, data_bpt=2.0):
    """Synthetic plant: the adapters' Σw² relaxes toward an equilibrium that falls as λ rises."""
    target_w2 = 1.0 / (1.0 + lam)
    return w2 + 0.3 * (target_w2 - w2)


def run_plant(c, steps, target_change=None):
    w2 = 1.0
    for t in range(steps):
        if target_change and t == target_change[0]:
            c.target_s = target_change[1]
        w2 = plant_param_bpt(c.lam, w2)
        c.update(2.0, 0.05 * w2, step=t)
    return c


def test_closed_loop_settles_and_saturates():
    c = SCUController(target_s=0.01, kp=0.8, ki=0.15, saturation_window=50)
    run_plant(c, 600)
    assert abs(c.s_hat - 0.01) <= c.deadband
    assert c.saturated_step is not None and c.saturated_step < 600


def test_closed_loop_resettles_after_target_change():
    c = SCUController(target_s=0.01, saturation_window=50)
    run_plant(c, 1200, target_change=(600, 0.015))
    assert abs(c.s_hat - 0.015) <= c.deadband
    lam_at_001 = SCUController(target_s=0.01)
    run_plant(lam_at_001, 600)
    assert c.lam < lam_at_001.lam            # a higher S* needs less regularisation


def test_controller_imports_no_heavy_modules():
    code = ("import sys, raytrain_scu.controller; "
            "bad = [m for m in ('torch', 'ray', 'mlflow') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_lambda_held_at_a_bound_is_said_once_per_stretch_with_what_it_means():
    from raytrain_scu.config.schema import ControllerConfig
    from raytrain_scu.core.bounds import BoundWatch

    c = ControllerConfig(mode="scu", law="spec", lambda_min=1e-4, lambda_max=10.0, target_s=0.01, bound_notice_steps=3)
    w = BoundWatch(c)
    said = [w.update(step, lam, s_hat) for step, lam, s_hat in
            [(1, 5.0, 0.5), (2, 10.0, 0.4), (3, 10.0, 0.3), (4, 10.0, 0.2), (5, 10.0, 0.1), (6, 10.0, 0.05)]]
    assert said[:4] == [None] * 4 and said[5] is None  # 3 steps at the bound are allowed, then one notice
    assert said[4].startswith("λ has sat at its upper bound 10 (controller.lambda_max) since step 2 (4 steps; Ŝ 0.1, "
                              "S* 0.01): S* is out of reach at these σ and N")
    assert "controller.prior_sigma" in said[4]
    assert w.update(7, 3.0, 0.02) is None  # λ left the bound: the next stretch is a new one
    later = [w.update(step, 10.0, 5e-5) for step in range(8, 12)]
    assert later[:3] == [None] * 3 and "Ŝ is already below S*, yet λ stays up: the plant is saturated" in later[3]
    assert "controller.integral_limit" in later[3]  # the spec's law: its integral holds λ there
    low = BoundWatch(c)
    assert [low.update(k, 1e-4, 0.001) for k in range(1, 5)][-1].startswith("λ has sat at its lower bound 0.0001")
    assert BoundWatch(ControllerConfig(mode="fixed", bound_notice_steps=1)).update(5, 10.0, 0.5) is None
    off = BoundWatch(ControllerConfig(mode="scu", bound_notice_steps=0))
    assert all(off.update(k, 10.0, 0.5) is None for k in range(1, 100))
    resumed = BoundWatch(c)  # a stretch carried over a checkpoint: neither restarted nor said again
    first = BoundWatch(c)
    assert [first.update(k, 10.0, 0.5) for k in (1, 2)] == [None, None]
    resumed.load_state_dict(first.state_dict())
    assert resumed.update(3, 10.0, 0.5) is None and "since step 1 (4 steps" in resumed.update(4, 10.0, 0.5)
    resumed.load_state_dict(resumed.state_dict())
    assert resumed.update(5, 10.0, 0.5) is None
    logodds = BoundWatch(ControllerConfig(mode="scu", law="logodds", lambda_max=10.0, target_s=0.01,
                                          bound_notice_steps=1))
    said = [logodds.update(k, 10.0, 5e-5) for k in (1, 2)][-1]  # past S* at the bound: the law's own advice
    assert "logodds law moves ln λ back by its integral term" in said and "controller.logodds_ki" in said
    assert "controller.integral_limit" not in said


def test_saturation_window_needs_a_full_flat_window_and_the_law_s_band():
    w = SaturationWindow(3, 0.01)
    for step, lam in enumerate((1.0, 1.0), start=1):
        w.record(lam, step, near=True)
    assert w.step is None                           # two of three: not full yet
    w.record(1.0099, 3, near=False)
    assert w.step is None                           # flat, but Ŝ is outside the law's band
    w.record(1.0, 4, near=True)
    assert w.step == 4                              # 1.0, 1.0099, 1.0: within 1 %, and Ŝ in the band
    v = SaturationWindow(2, 0.01)
    v.record(1.0, 1, near=True)
    v.record(1.02, 2, near=True)
    assert v.step is None                           # 2 % apart: not flat
    v.record(1.02, 3, near=True)
    assert v.step == 3                              # the first step that holds is kept ...
    v.record(5.0, 4, near=True)
    v.record(5.0, 5, near=True)
    assert v.step == 3                              # ... and never moves
    zero = SaturationWindow(2, 0.01)
    for step in (1, 2):
        zero.record(0.0, step, near=True)
    assert zero.step == 2                           # λ = 0 throughout (mode none) counts as flat
    again = SaturationWindow(2, 0.01)
    again.load_state_dict(json.loads(json.dumps(v.state_dict())))
    assert again.state_dict() == {"lam_window": [5.0, 5.0], "saturated_step": 3}
