"""The config: one dataclass tree (:mod:`.schema`, the only home of defaults), YAML and ``key=value`` text in and out
(:mod:`.io`), cross-field checks (:mod:`.checks`), the strict build (:mod:`.load`) and where a run lives
(:mod:`.paths`) — all pure, importing nothing of the package but :mod:`raytrain_scu.errors` (``tests/test_layout.py``
checks it).

The front door every CLI uses is :func:`raytrain_scu.driver.resolve.resolve`: the build, then the hardware preset and
the memory fit, each once. It reads the card and the model's config, so it sits above ``core``, on the driver's
floor::

    from raytrain_scu.driver.resolve import resolve
    cfg = resolve("experiments/tiny-cpu.yaml", ["train.max_steps=200", "controller.mode=fixed"])
"""
