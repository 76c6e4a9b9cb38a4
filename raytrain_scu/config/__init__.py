"""The config: one dataclass tree (:mod:`.schema`, the only home of defaults), YAML and ``key=value`` text in and out
(:mod:`.io`), cross-field checks (:mod:`.checks`), the strict build (:mod:`.load`) and where a run lives
(:mod:`.paths`) — all pure, importing nothing of the package above :mod:`raytrain_scu.errors`.

:func:`raytrain_scu.config.resolve.resolve` is the front door every CLI uses: the build, then the hardware preset
and the memory fit, each once. It reads the card and the model's shape, so it sits above ``core`` and is not
imported here::

    from raytrain_scu.config.resolve import resolve
    cfg = resolve("experiments/tiny-cpu.yaml", ["train.max_steps=200", "controller.mode=fixed"])
"""
