"""What GPUs are here and what a run needs of them, in pure Python (no torch, ray or mlflow at import; NVML is
imported inside :func:`~raytrain_scu.hardware.gpus.detect_gpus`):

- :mod:`.gpus`: the NVIDIA cards through NVML (none is not an error), each card's dense bf16 peak and MFU, and what
  a built model holds on the GPU;
- :mod:`.presets`: a set of config values per kind of card, and which preset suits the cards found;
- :mod:`.memory`: the peak-memory estimator for LoRA/QLoRA and the largest batch that fits a card;
- :mod:`.envcheck`: the environment checks behind ``python -m raytrain_scu.check``.

On a Ray cluster the driver usually runs on a CPU head node: ``auto`` must be resolved with the GPUs of a worker,
e.g. ``ray.get(ray.remote(num_gpus=1)(detect_gpus).remote())`` passed as ``gpus=`` to ``driver.resolve.resolve``.
"""
