"""raytrain_scu: LoRA fine-tuning under the Shannon Control Unit, on Ray Train, swept with Ray Tune, in MLflow."""
import logging
import warnings

# bitsandbytes (which peft imports) logs at import, on CPUs with AVX512-BF16, that the optional `kernels` package for
# its CPU 4-bit kernel is missing: a line that reads like a broken install. 4-bit bases run on CUDA only here
# (quant.load_in_4bit), so that kernel is never used; the logger is set before any module imports peft.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
# peft reads transformers' deprecated `is_gradient_checkpointing` each time it wraps a model: transformers' own
# FutureWarning about peft's code, which the person running a command can do nothing about
warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
