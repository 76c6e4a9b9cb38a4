"""What a run records about itself, without Ray: which checkpoint is "best", the λ shown beside S."""
import math
import re
from pathlib import Path

from raytrain_scu.train import best_checkpoint


def test_best_checkpoint_is_the_lowest_val_bpt_in_any_order():
    # Result.best_checkpoints as Ray 2.60 orders it (by score, worst first), with a NaN and a report without val
    ray_order = [("nan", {"step": 5, "val/data_bpt": math.nan}), ("no-val", {"step": 8}),
                 ("s15", {"step": 15, "val/data_bpt": 10.944}), ("s20", {"step": 20, "val/data_bpt": 10.939})]
    for order in (ray_order, ray_order[::-1], [ray_order[2], ray_order[0], ray_order[3], ray_order[1]]):
        assert best_checkpoint(order)[0] == "s20"
    tie = [("s10", {"step": 10, "val/data_bpt": 3.0}), ("s30", {"step": 30, "val/data_bpt": 3.0})]
    assert best_checkpoint(tie)[0] == "s30"  # a tie goes to the later step
    assert best_checkpoint(ray_order[:2]) is None and best_checkpoint([]) is None and best_checkpoint(None) is None


def report(**over):
    return {"step": 7, "max_steps": 20, "train/data_bpt": 5.0, "val/data_bpt": 5.5, "ctrl/s": 0.25,
            "ctrl/s_hat": 0.3, "ctrl/lambda_applied": 0.125, "ctrl/lambda": 0.5, **over}


def test_progress_line_shows_the_lambda_the_loss_used_beside_s(capsys):
    from raytrain_scu.train import _progress_callback

    _progress_callback().after_report(None, [report()], None)
    line = capsys.readouterr().out
    lam = re.search(r"λ\S* (\S+)", line)
    assert lam and float(lam.group(1)) == 0.125, line  # ctrl/lambda_applied, not ctrl/lambda (next step's)
    assert "S 0.25" in line


def test_lambda_plot_pairs_each_step_with_the_lambda_its_loss_used(tmp_path, monkeypatch):
    import matplotlib.figure

    from raytrain_scu.plots import plot_history

    drawn = {}
    save = matplotlib.figure.Figure.savefig

    def keep_lines(fig, fname, *args, **kwargs):  # what each PNG shows, then the real save
        drawn[Path(fname).name] = [(line.get_label(), list(line.get_xdata()), list(line.get_ydata()))
                                   for ax in fig.axes for line in ax.get_lines() if len(line.get_xdata()) > 2]
        return save(fig, fname, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep_lines)
    # λ the loss used in step t, and λ after step t's update (= step t+1's): they differ by one step
    applied = [1.0, 2.0, 4.0, 8.0]
    history = [{"step": 0, "val/data_bpt": 6.0, "ctrl/lambda": 1.0}]
    history += [{"step": t, "ctrl/s": 0.1 * t, "ctrl/s_hat": 0.1 * t, "train/data_bpt": 5.0, "train/param_bpt": 0.1,
                 "ctrl/lambda_applied": lam, "ctrl/lambda": 2 * lam} for t, lam in zip(range(1, 5), applied)]
    plot_history(history, tmp_path, target_s=0.2, title="t")
    assert (tmp_path / "lambda.png").stat().st_size > 0
    lines = {label: (xs, ys) for label, xs, ys in drawn["lambda.png"]}
    lam_label = next(label for label in lines if "λ" in label)
    assert "applied" in lam_label
    assert lines[lam_label] == ([1, 2, 3, 4], applied)
    assert lines["S"] == ([1, 2, 3, 4], [0.1 * t for t in range(1, 5)])  # in the same figure, on the same steps
