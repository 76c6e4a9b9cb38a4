"""ablation.py without Ray: control statistics of a known trace, the summary and its tables (NaN as '-', gains apart,
rows in order), JSON without NaN, the arms' overrides as valid sweeps, unfinished trials and checkpoints refused."""
import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import ROOT
from raytrain_scu import ablation, sweep_space
from raytrain_scu.checkpoint import write_checkpoint
from raytrain_scu.config import load_config, run_dir

ABLATION_YAML = str(ROOT / "experiments" / "ablation-smollm2.yaml")
LN2 = math.log(2.0)


# ---------------------------------------------------------------- control statistics

def test_control_stats_of_a_known_trace():
    hist = [{"step": 0, "val/data_bpt": 9.0}]  # the loop's start row: no controller keys, left out
    s_hat = [0.5, 0.4, 0.03, 0.01, 0.02, 0.01, 0.03, 0.01, 0.02, 0.01]
    lam = [1.0, 1.5, 2.0, 4.0, 3.0, 2.0, 5.0, 4.0, 3.0, 2.5]
    hist += [{"step": i + 1, "ctrl/s_hat": s, "ctrl/lambda": g} for i, (s, g) in enumerate(zip(s_hat, lam))]
    hist[7]["ctrl/saturated_step"] = 7
    st = ablation.control_stats(hist, target_s=0.02, warmup_frac=0.2)  # the first 2 of 10 steps are warm-up
    err = np.array(s_hat[2:]) - 0.02
    assert st["rms_tracking_error"] == pytest.approx(math.sqrt(np.mean(err ** 2)))
    assert st["lambda_swing"] == pytest.approx(5.0 / 2.0)  # not 5/1: step 1's λ is in the warm-up
    assert st["final_lambda"] == 2.5 and st["final_s_hat"] == 0.01 and st["saturated_step"] == 7
    off = ablation.control_stats([{"step": i, "ctrl/s_hat": 0.03, "ctrl/lambda": 0.0} for i in range(1, 6)], 0.01)
    assert math.isnan(off["lambda_swing"]) and off["saturated_step"] is None  # λ = 0 (none): no swing


# ---------------------------------------------------------------- summary and tables

def trial(family, arm, seed, nats, tokens, none_nats, *, swing=1.0):
    nats, tokens = np.asarray(nats, float), np.asarray(tokens, float)
    return {"family": family, "arm": arm, "seed": seed, "nats": nats, "tokens": tokens,
            "none_nats": np.asarray(none_nats, float), "val_bpt": nats.sum() / tokens.sum() / LN2,
            "base_bpt": 7.0, "rms_tracking_error": 0.01, "lambda_swing": swing, "final_lambda": 1.0,
            "final_s_hat": 0.02, "saturated_step": None}


@pytest.fixture
def rows():
    rng = np.random.default_rng(0)
    trials = []
    for seed in range(3):
        tokens = rng.integers(50, 200, 8)
        none = tokens * rng.uniform(3.0, 4.0, 8)
        trials.append(trial("none", "none", seed, none, tokens, none, swing=math.nan))
        # listed before λ=1 and with a worse gap: the tables still order arms by λ
        trials.append(trial("fixed", "fixed λ=10", seed, none + 0.05 * tokens, tokens, none))
        trials.append(trial("fixed", "fixed λ=1", seed, none - 0.01 * tokens, tokens, none))
        if seed == 0:
            trials.append(trial("gains", "scu Kp=0.8 Ki=0.15", seed, none - 0.02 * tokens, tokens, none))
    return ablation.summarize({"trials": trials, "n_boot": 200})


def test_summarize_pools_seeds_and_pairs_with_none(rows):
    by_arm = {r["arm"]: r for r in rows}
    assert [r["arm"] for r in rows] == ["none", "fixed λ=1", "fixed λ=10", "scu Kp=0.8 Ki=0.15"]
    assert by_arm["none"]["gap_to_none"] == by_arm["none"]["gap_ci_low"] == 0.0
    assert by_arm["fixed λ=10"]["gap_to_none"] == pytest.approx(0.05 / LN2)  # nats per token → bits
    assert by_arm["fixed λ=1"]["gap_to_none"] == pytest.approx(-0.01 / LN2)
    assert by_arm["fixed λ=1"]["seeds"] == 3 and math.isfinite(by_arm["fixed λ=1"]["val_bpt_ci95"])
    assert by_arm["scu Kp=0.8 Ki=0.15"]["seeds"] == 1 and math.isnan(by_arm["scu Kp=0.8 Ki=0.15"]["val_bpt_ci95"])
    assert math.isnan(by_arm["none"]["lambda_swing"])


def test_markdown_prints_undefined_as_dash_and_gains_apart(rows):
    text = ablation.markdown(rows)
    assert "nan" not in text.lower()
    arms_table, gains_table = text.split("\n\n")
    arm_lines = arms_table.splitlines()[2:]
    assert [line.split(" | ")[0] for line in arm_lines] == ["| none", "| fixed λ=1", "| fixed λ=10"]
    none_cells = [c.strip() for c in arm_lines[0].strip("|").split("|")]
    assert none_cells[5] == "-" and none_cells[8] == "-, -, -"  # λ swing of λ = 0; never saturated
    assert "±" in none_cells[2]
    gains_line, = gains_table.splitlines()[2:]
    gains_cells = [c.strip() for c in gains_line.strip("|").split("|")]
    assert gains_cells[0] == "scu Kp=0.8 Ki=0.15" and "±" not in gains_cells[2]  # one seed: no interval
    # shuffled input, same tables
    assert ablation.markdown(rows[::-1]) == text


def test_results_json_is_valid_and_gives_the_same_tables(rows):
    written = json.dumps(ablation.json_ready(rows), allow_nan=False)
    back = json.loads(written)
    assert back[0]["lambda_swing"] is None
    assert ablation.markdown(back) == ablation.markdown(rows)


# ---------------------------------------------------------------- the arms as sweeps

def test_arm_overrides_are_valid_grid_sweeps():
    sweeps = ablation.arm_sweeps(seeds=[0, 1], lambdas=[0.1, 1.0], targets=[0.005, 0.02], gains=([0.2, 0.8], [0.05]))
    assert list(sweeps) == list(ablation.FAMILIES)
    spaces = {}
    for family, extra in sweeps.items():
        cfg = load_config(ABLATION_YAML, [*extra, "tune.search=grid", "tune.scheduler=none"])
        spaces[family] = sweep_space.resolve_space(cfg)
        assert cfg.controller.mode == ("none" if family == "none" else "fixed" if family == "fixed" else "scu")
    assert spaces["none"] == {"seed": {"grid": [0, 1]}}
    assert spaces["fixed"]["controller.lambda_init"] == {"grid": [0.1, 1.0]}
    assert spaces["scu"]["controller.target_s"] == {"grid": [0.005, 0.02]}
    assert spaces["gains"] == {"controller.kp": {"grid": [0.2, 0.8]}, "controller.ki": {"grid": [0.05]}}


def test_unfinished_trials_are_refused():
    done = {"trial": "a", "status": "FINISHED"}
    ablation.check_finished("s-none", [done])
    with pytest.raises(ablation.AblationError, match=r"2 trial\(s\).*b \(FAILED\), c \(KILLED\)"):
        ablation.check_finished("s-none", [done, {"trial": "b", "status": "FAILED"},
                                           {"trial": "c", "status": "KILLED"}])


def test_trial_run_is_the_sweeps_trial(tmp_path):
    family = load_config(ABLATION_YAML, ["controller.mode=scu", f"run.storage_path={tmp_path}", "run.name=ab-scu",
                                         "tune.space={controller.target_s: {grid: [0.02]}, seed: {grid: [2]}}"])
    cfg, trial_dir = ablation.trial_run(family, {"trial": "t123", "params": {"controller.target_s": 0.02, "seed": 2}})
    assert cfg.seed == 2 and cfg.controller.target_s == 0.02
    assert trial_dir.is_relative_to(Path(run_dir(family))) and trial_dir.name.endswith("t123")


# ---------------------------------------------------------------- checkpoints

def fake_checkpoint(path, step, history):
    """A real write_checkpoint (manifest and all) of stand-in model and optimizer state."""
    def save_pretrained(out, safe_serialization=True):
        Path(out).mkdir(parents=True)
        (Path(out) / "adapter_model.safetensors").write_bytes(b"w" * 64)

    state = SimpleNamespace(state_dict=lambda: {})
    return write_checkpoint(path, model=SimpleNamespace(save_pretrained=save_pretrained), optimizer=state,
                            scaler=state, controller_state={}, step=step, position=0, structure={},
                            tokens_per_epoch=1, config_yaml="", history=history)


def test_final_checkpoint_verifies_and_must_be_the_last_step(tmp_path):
    with pytest.raises(ablation.AblationError, match="no checkpoint"):
        ablation.final_checkpoint(tmp_path, 30)
    fake_checkpoint(tmp_path / "checkpoint_000000", 10, [{"step": 10}])
    final = fake_checkpoint(tmp_path / "checkpoint_000001", 30, [{"step": 30}])
    assert ablation.final_checkpoint(tmp_path, 30) == final
    assert ablation.history(final) == [{"step": 30}]
    # the final one truncated: the older good one is not taken in its place
    (final / "state.pt").write_bytes((final / "state.pt").read_bytes()[:10])
    with pytest.raises(ablation.AblationError, match="checkpoint_000000 is of step 10.*checkpoint_000001"):
        ablation.final_checkpoint(tmp_path, 30)
