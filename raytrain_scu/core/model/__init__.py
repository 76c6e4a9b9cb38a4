"""Model building blocks: where a model comes from (:mod:`.source`), the random-init presets (:mod:`.presets`),
what the package knows per model family (:mod:`.families`), building the base and its LoRA adapters (:mod:`.build`)
and the FLOP count (:mod:`.flops`). No ray, mlflow or torch.distributed."""
