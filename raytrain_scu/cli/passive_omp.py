"""Imported first by the CLIs that run a model in their own process (``evaluate``, ``generate``), before torch loads:
OpenMP threads that wait by sleeping, not spinning. The model runs on every core torch sees, and threads spinning on
cores that other processes also use made scoring 10x slower on a busy 2-core machine (16 tokens/s against 192 with
this, SmolLM2-135M). An exported OMP_WAIT_POLICY wins."""
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
