# One-off run (not part of the package): the bench with this process's device memory capped, to see which parts fit.
# bench/h200_2026-11-28_capped_28g_8b.json came from these same calls written inline (python -c) on one H200; as a
# file: python docs/bench/probes/capped_bench.py 28.25 --parts ours_acts_host_8b,ours_8b --batch 2 --steps 10 \
#   --out x.json
import runpy
import sys

import torch

cap_gib = float(sys.argv[1])
total = torch.cuda.get_device_properties(0).total_memory
torch.cuda.set_per_process_memory_fraction(cap_gib * 2**30 / total)  # the caching allocator's limit for this process
print("cap GiB", cap_gib, "of", round(total / 2**30, 2))
sys.argv = ["bench", *sys.argv[2:]]
runpy.run_module("raytrain_scu.bench", run_name="__main__")
