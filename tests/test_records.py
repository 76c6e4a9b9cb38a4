"""What a run records about itself, without Ray: which checkpoint is "best"."""
import math

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
