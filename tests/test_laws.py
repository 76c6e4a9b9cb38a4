"""The control-law table (core.laws): the logodds law step by step against a plain re-implementation, its
anti-windup at both bounds, exact resume, the spec's skip rule, the shared telemetry and the config keys."""
import json
import math
import random
import subprocess
import sys

import pytest

from raytrain_scu.config.checks import check_controller
from raytrain_scu.config.schema import ControllerConfig
from raytrain_scu.controller import SCUController
from raytrain_scu.core import laws
from raytrain_scu.core.laws import LAWS, LogOddsController
from raytrain_scu.errors import ConfigError

TELEMETRY = ("lam", "integral", "s", "s_hat", "error", "n_updates", "n_skipped", "saturated", "saturated_step")


def inputs(n, seed=0):
    """A run-like input sequence: DataBPT with noise, ParamBPT collapsing from A's init then regrowing, lr factors."""
    rng = random.Random(seed)
    rows = []
    for t in range(n):
        param_bpt = 60.0 * math.exp(-t / 8.0) + 1.5 * (1 - math.exp(-t / 30.0)) + 0.01
        rows.append((4.8 + rng.gauss(0, 0.15), param_bpt, min(1.0, (t + 1) / 20) * (1 - 0.5 * t / n)))
    return rows


def reference_lambdas(rows, target_s, kp, ki, alpha, max_error, max_step, hold_error, lam, lam_min, lam_max):
    """The logodds law written out plainly (the module docstring's six steps), for comparison."""
    out, d_hat, e_prev, raw_prev = [], None, None, None
    z = math.log(target_s / (1 - target_s))
    for data_bpt, param_bpt, ell in rows:
        d_hat = data_bpt if d_hat is None else alpha * data_bpt + (1 - alpha) * d_hat
        s_hat = param_bpt / (d_hat + param_bpt)
        raw = math.log(s_hat / (1 - s_hat)) - z
        e = max(-max_error, min(max_error, raw))
        if e_prev is None:
            e_prev, raw_prev = e, raw
        hold = abs(raw) > hold_error and raw * (raw - raw_prev) < 0
        v = kp * (e - e_prev) + (0.0 if hold else ki * ell * e)
        v = max(-max_step, min(max_step, v))
        lam = math.exp(max(math.log(lam_min), min(math.log(lam_max), math.log(lam) + v)))
        out.append(lam)
        e_prev, raw_prev = e, raw
    return out


@pytest.mark.parametrize("params", [
    dict(target_s=0.241, kp=2.0, ki=0.2, alpha=0.1, max_error=2.0, max_step=0.25, hold_error=1.0),
    dict(target_s=0.05, kp=0.5, ki=0.05, alpha=0.3, max_error=1.0, max_step=0.1, hold_error=0.5),
    dict(target_s=0.6, kp=0.0, ki=0.4, alpha=1.0, max_error=3.0, max_step=2.0, hold_error=5.0),
])
def test_agrees_step_by_step_with_a_plain_reimplementation(params):
    rows = inputs(300)
    c = LogOddsController(target_s=params["target_s"], kp=params["kp"], ki=params["ki"],
                          data_alpha=params["alpha"], max_error=params["max_error"], max_step=params["max_step"],
                          hold_error=params["hold_error"], lambda_init=1.0, lambda_min=1e-4, lambda_max=1e3)
    ref = reference_lambdas(rows, **params, lam=1.0, lam_min=1e-4, lam_max=1e3)
    got = [c.update(d, p, step=t + 1, lr_factor=ell) for t, (d, p, ell) in enumerate(rows)]
    assert got == pytest.approx(ref, rel=1e-12, abs=0)
    assert len(set(round(math.log(v), 6) for v in got)) > 30  # the inputs moved λ: the comparison is not vacuous


def test_first_update_hand_worked():
    c = LogOddsController(target_s=0.25, kp=2.0, ki=0.2, data_alpha=0.1, lambda_init=1.0)
    lam = c.update(4.0, 2.0, lr_factor=0.5)     # S = 1/3: ε = ln(0.5) − ln(1/3) = ln 1.5; ε_prev = ε, no hold
    eps = math.log(1.5)
    assert c.s == c.s_hat == pytest.approx(1 / 3)
    assert c.log_odds_error == pytest.approx(eps)
    assert lam == pytest.approx(math.exp(0.2 * 0.5 * eps))  # only the integral step moves it
    assert c.integral == pytest.approx(math.log(lam) - 2.0 * eps)
    assert c.error == pytest.approx(1 / 3 - 0.25)


def test_only_data_bpt_is_filtered():
    c = LogOddsController(target_s=0.25, data_alpha=0.1)
    c.update(4.0, 1.0)
    c.update(6.0, 3.0)                          # D̂ = 0.1·6 + 0.9·4 = 4.2; P is taken as it is
    assert c.d_hat == pytest.approx(4.2)
    assert c.s_hat == pytest.approx(3.0 / 7.2) and c.s == pytest.approx(3.0 / 9.0)


def test_anti_windup_at_the_upper_bound():
    c = LogOddsController(target_s=0.1, kp=1.0, ki=0.5, max_step=1.0, hold_error=100.0, lambda_max=10.0)
    for _ in range(200):                        # S far above target for a long time: λ pinned at its bound
        c.update(4.0, 40.0)
    assert c.lam == 10.0
    assert abs(c.integral - (math.log(10.0) - c.kp * c.log_odds_error)) < 1e-12  # nothing beyond the bound
    c.update(4.0, 0.04)                         # one update below target: λ leaves the bound by a full step
    assert c.lam == pytest.approx(10.0 / math.e, rel=1e-12)


def test_anti_windup_at_the_lower_bound():
    c = LogOddsController(target_s=0.3, kp=1.0, ki=0.5, max_step=1.0, hold_error=100.0, lambda_min=1e-3)
    for _ in range(200):
        c.update(4.0, 1e-6)
    assert c.lam == 1e-3
    c.update(4.0, 40.0)
    assert c.lam == pytest.approx(1e-3 * math.e, rel=1e-12)


def test_hold_keeps_lambda_while_a_large_error_closes():
    c = LogOddsController(target_s=0.1, kp=0.0, ki=0.5, hold_error=1.0, max_step=5.0)
    c.update(4.0, 60.0)
    lam = c.lam
    for p in (50.0, 40.0, 30.0):                # far above target, falling: no integration
        c.update(4.0, p)
        assert c.held and c.lam == lam
    c.update(4.0, 31.0)                         # no longer closing: it integrates again
    assert not c.held and c.lam > lam


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("which", [0, 1])
def test_non_finite_input_is_skipped_like_the_spec(bad, which):
    c = LogOddsController(target_s=0.2)
    spec = SCUController(target_s=0.2)
    for ctrl in (c, spec):
        ctrl.update(4.0, 2.0)
    before = c.state_dict()
    args = [4.0, 2.0]
    args[which] = bad
    assert c.update(*args, lr_factor=1.0) == before["lam"]
    assert spec.update(*args) == spec.lam
    after = c.state_dict()
    assert after["n_skipped"] == 1 and spec.n_skipped == 1 and after["n_updates"] == 1
    assert {k: v for k, v in after.items() if k != "n_skipped"} == {k: v for k, v in before.items() if k != "n_skipped"}


@pytest.mark.parametrize("cut", [1, 17, 150])
def test_state_dict_round_trip_resumes_exactly(cut):
    rows = inputs(300, seed=3)

    def fresh():
        return LogOddsController(target_s=0.241, lambda_min=1e-4, lambda_max=1e3, saturation_window=20)

    whole = fresh()
    ref = [whole.update(d, p, step=t + 1, lr_factor=f) for t, (d, p, f) in enumerate(rows)]
    first = fresh()
    for t, (d, p, f) in enumerate(rows[:cut]):
        first.update(d, p, step=t + 1, lr_factor=f)
    resumed = fresh()
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    got = [resumed.update(d, p, step=t + 1, lr_factor=f) for t, (d, p, f) in enumerate(rows[cut:], start=cut)]
    assert got == ref[cut:]                     # exact, not approximately
    assert resumed.state_dict() == whole.state_dict()


def test_state_of_another_law_or_mode_is_refused():
    c = LogOddsController()
    with pytest.raises(ValueError, match="law"):
        c.load_state_dict(SCUController().state_dict() | {"law": "spec"})
    with pytest.raises(ValueError, match="mode"):
        c.load_state_dict(LogOddsController(mode="fixed").state_dict())


def test_modes_fixed_and_none_measure_only():
    for mode, lam in (("fixed", 0.3), ("none", 0.0)):
        c = LogOddsController(mode=mode, lambda_init=0.3, target_s=0.2)
        for d, p, f in inputs(50):
            assert c.update(d, p, lr_factor=f) == lam
        assert c.s_hat > 0 and c.n_updates == 50


def test_every_law_has_the_spec_telemetry_and_the_loop_can_call_it():
    for name, cls in LAWS.items():
        c = laws.build(ControllerConfig(mode="scu", law=name, target_s=0.2))
        assert isinstance(c, cls)
        lam = laws.update(c, 4.0, 2.0, step=1, lr_factor=0.5)
        for attr in TELEMETRY:
            assert hasattr(c, attr), (name, attr)
        assert lam == c.lam and c.n_updates == 1
        json.dumps(c.state_dict())
    assert LAWS["spec"] is SCUController


def test_spec_law_from_the_table_is_the_spec_law_unchanged():
    rows = inputs(100)
    direct = SCUController(target_s=0.2, lambda_max=1e3)
    built = laws.build(ControllerConfig(mode="scu", law="spec", target_s=0.2, lambda_max=1e3))
    for t, (d, p, f) in enumerate(rows):
        assert laws.update(built, d, p, step=t + 1, lr_factor=f) == direct.update(d, p, step=t + 1)


def test_config_defaults_and_checks_for_the_new_keys():
    c = ControllerConfig()
    assert c.law == "logodds" and (c.kp, c.ki, c.lambda_init, c.lambda_max) == (0.8, 0.15, 1.0, 10.0)
    assert (c.logodds_kp, c.logodds_ki) == (2.0, 0.2)
    assert isinstance(laws.build(c), LogOddsController)  # the default config runs the logodds law
    check_controller(ControllerConfig(law="spec"))
    for key, value in (("law", "pid"), ("logodds_kp", -1.0), ("logodds_ki", -0.1), ("logodds_data_alpha", 0.0),
                       ("logodds_data_alpha", 1.5), ("logodds_max_error", 0.0), ("logodds_max_step", -1.0),
                       ("logodds_hold_error", 0.0)):
        with pytest.raises(ConfigError, match=f"controller.{key}"):
            check_controller(ControllerConfig(**{key: value}))
    with pytest.raises(ConfigError, match="controller.logodds_ki"):
        LogOddsController(ki=-1.0)


def test_each_law_reads_exactly_its_own_keys_of_law_keys():
    """config.schema.LAW_KEYS (the keys config.checks refuses where their law does not run) are the keys one law's
    builder reads and the other's does not: ema_alpha, deadband, leak and integral_limit are the spec's alone."""
    from raytrain_scu.config.schema import LAW_KEYS

    class Reads:
        """A ControllerConfig that records the keys read from it."""

        def __init__(self, law):
            self.c, self.keys = ControllerConfig(law=law), set()

        def __getattr__(self, name):
            self.keys.add(f"controller.{name}")
            return getattr(self.c, name)

    reads = {}
    for law in LAWS:
        r = Reads(law)
        laws.build(r)
        reads[law] = r.keys
    only = {law: keys - set().union(*(reads[o] for o in LAWS if o != law)) for law, keys in reads.items()}
    assert only == {law: set(keys) for law, keys in LAW_KEYS.items()}
    assert {"controller.target_s", "controller.lambda_max", "controller.mode"} <= reads["spec"] & reads["logodds"]


def test_config_file_override_selects_the_law():
    from conftest import TINY

    from raytrain_scu.config.load import load_config

    cfg = load_config(TINY, ["controller.law=logodds", "controller.logodds_kp=1.5"])
    assert isinstance(laws.build(cfg.controller), LogOddsController) and laws.build(cfg.controller).kp == 1.5
    cfg = load_config(TINY, ["controller.law=spec", "controller.kp=0.5"])
    assert isinstance(laws.build(cfg.controller), SCUController) and laws.build(cfg.controller).kp == 0.5
    with pytest.raises(ConfigError, match="controller.law"):
        load_config(TINY, ["controller.law=bang_bang"])


def test_laws_import_no_heavy_modules():
    code = ("import sys, raytrain_scu.core.laws, raytrain_scu.core.plant, raytrain_scu.core.settling; "
            "bad = [m for m in ('torch', 'ray', 'mlflow') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_loop_runs_a_law_from_the_table_and_logs_its_own_telemetry(tmp_path):
    """controller.law=logodds in the real loop (one process): every report row carries the law's own metrics beside
    the spec's, λ moves, and the checkpoint structure names the law (a resume under another law is refused)."""
    import torch
    from conftest import tiny_cfg

    from raytrain_scu.core.checkpoint import check_structure
    from raytrain_scu.core.model.build import structure_of
    from raytrain_scu.errors import CheckpointError
    from raytrain_scu.worker.hooks import LocalHooks
    from raytrain_scu.worker.loop import run_loop

    cfg = tiny_cfg(tmp_path, "logodds", "controller.law=logodds", "controller.target_s=0.2", "scaling.num_workers=1",
                   "tracking.enabled=false", "train.max_steps=6", "train.report_every=2", "train.checkpoint_every=6")
    hooks = LocalHooks(device=torch.device("cpu"))
    run_loop(cfg, hooks=hooks)
    rows = hooks.reports
    assert [r["step"] for r in rows] == [2, 4, 6]
    assert all({"ctrl/log_odds_error", "ctrl/raw_error", "ctrl/d_hat", "ctrl/held", "ctrl/s_hat"} <= set(r)
               for r in rows)
    assert len({r["ctrl/lambda"] for r in rows}) > 1
    spec = structure_of(tiny_cfg(tmp_path, "logodds", "controller.law=spec"), use_gpu=False)
    with pytest.raises(CheckpointError, match="controller.law: checkpoint has 'logodds', config has 'spec'"):
        check_structure({"structure": structure_of(cfg, use_gpu=False)}, spec)
    older = {"structure": {k: v for k, v in spec.items() if k != "controller.law"}}  # from before the key: spec's
    check_structure(older, spec)
    with pytest.raises(CheckpointError, match=r"controller.law: checkpoint has 'spec', config has 'logodds'\)\. To "
                                              r"resume it, set controller\.law=spec\."):
        # the default law resumes no spec state
        check_structure(older, structure_of(tiny_cfg(tmp_path, "logodds"), use_gpu=False))
