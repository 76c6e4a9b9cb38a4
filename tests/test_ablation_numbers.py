"""The helpers both versions of the ablation's report share (studies.ablation.numbers), on hand-worked numbers."""
import math

import pytest

from raytrain_scu.studies.ablation import numbers as n


def test_mean_ci_is_the_t_interval_half_width():
    mean, half = n.mean_ci([1.0, 2.0, 3.0])                 # sd 1, n 3, t(2) = 4.303
    assert mean == 2.0 and half == pytest.approx(4.303 / math.sqrt(3))
    sd = math.sqrt(24 * 0.25 / 23)                          # twelve 1s and twelve 2s
    assert n.mean_ci([1.0] * 12 + [2.0] * 12)[1] == pytest.approx(2.060 * sd / math.sqrt(24))  # df 23: row 25's t
    sd = math.sqrt(80 / 79)                                 # forty 1s and forty 3s
    assert n.mean_ci([1.0] * 40 + [3.0] * 40)[1] == pytest.approx(1.96 * sd / math.sqrt(80))   # df 79: beyond 30
    one = n.mean_ci([5.0])
    assert one[0] == 5.0 and math.isnan(one[1])
    assert all(math.isnan(x) for x in n.mean_ci([]))


def test_bootstrap_interval_covers_a_constant_gap_exactly_and_widens_with_noise():
    tokens = [100, 100, 100, 100]
    same = n.bootstrap_interval([([110.0] * 4, [100.0] * 4, tokens)], n_boot=200)
    assert same == pytest.approx((10 / 100 / n.LN2, 10 / 100 / n.LN2))  # every resample gives the same gap
    lo, hi = n.bootstrap_interval([([100.0, 120.0, 90.0, 130.0], [100.0] * 4, tokens)], n_boot=2000)
    assert lo < 10 / 100 / n.LN2 < hi
    assert all(math.isnan(x) for x in n.bootstrap_interval([], n_boot=10))


def test_numbers_print_as_both_reports_print_them(tmp_path):
    assert n.num(0.12345, ".3f") == "0.123" and n.num(None, ".3f") == "-" and n.num(math.nan, ".3f") == "-"
    assert n.interval(-0.01, math.inf) == "[-0.0100, -]"
    assert n.steps([3, None, 10]) == "3, -, 10"
    out, doc = tmp_path / "study", tmp_path / "doc.md"
    out.mkdir()
    (out / "notes.md").write_text("notes")
    n.write_doc(out, doc, lambda rel: f"see {rel}")
    assert doc.read_text() == (f"notes\n\n## The numbers (generated from {out}/results.json by `python -m "
                               f"raytrain_scu.ablation_report {out} --doc {doc}`)\n\nsee study\n")
