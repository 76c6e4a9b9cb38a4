"""Rebuild a trained run's base model and adapter for generation (``python -m raytrain_scu.generate``), and the
recipe a run writes so that a random-init preset can be rebuilt exactly."""
from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml

from raytrain_scu.config.load import build_config
from raytrain_scu.config.schema import Config
from raytrain_scu.errors import ConfigError, GenerateError

BASE_RECIPE = "base_model.json"


def find_run(path: str) -> tuple[Config, Path, dict]:
    """(config, adapter directory, base recipe) of a run directory, its output/ or a checkpoint directory."""
    from raytrain_scu.core.checkpoint import newest_good_local
    from raytrain_scu.errors import CheckpointError

    p = Path(path).expanduser()
    if not p.is_dir():
        raise GenerateError(f"run directory not found: {p}")
    for out in (p / "output", p):
        if (out / "config.yaml").is_file() and (out / "adapter" / "adapter_config.json").is_file():
            recipe = json.loads((out / BASE_RECIPE).read_text()) if (out / BASE_RECIPE).is_file() else {}
            return _config(out / "config.yaml"), out / "adapter", recipe
    try:  # an unfinished run: its newest checkpoint that verifies
        ckpt, _ = newest_good_local(p)
    except CheckpointError as e:
        raise GenerateError(str(e)) from None
    if ckpt is None:
        raise GenerateError(f"{p} holds no finished run (output/config.yaml + output/adapter) and no checkpoint_*")
    recipe_file = p / "output" / BASE_RECIPE
    return _config(ckpt / "config.yaml"), ckpt / "adapter", (json.loads(recipe_file.read_text())
                                                               if recipe_file.is_file() else {})


def _config(path: Path) -> Config:
    try:
        return build_config(yaml.safe_load(path.read_text()) or {})
    except ConfigError as e:
        raise GenerateError(f"{path}: {e}") from None


def base_recipe(cfg: Config, *, use_gpu: bool, vocab_size: int) -> dict:
    """What rebuilds a run's base model (the driver writes it beside the adapter): the model's name, and for a
    random-init preset the seed, dtype and device type its weights were drawn with (a seeded init on a GPU draws other
    numbers than on a CPU; under scaling.strategy=fsdp rank 0 draws it on its CPU: core.model.build.preset_init_device,
    from ``cfg``'s resolved strategy). With ``model.precision=auto`` on GPU workers the dtype is resolved here when
    this machine has a GPU, else bf16 (what auto picks on every GPU this package has presets for)."""
    from raytrain_scu.core.model.build import preset_init_device, resolve_dtype

    device = torch.device("cuda" if use_gpu else "cpu")  # the workers': their compute dtype is the draw's
    if cfg.model.precision == "auto" and use_gpu and not torch.cuda.is_available():
        dtype = torch.bfloat16
    else:
        dtype = resolve_dtype(cfg.model.precision, device)
    drawn_on = preset_init_device(cfg.model.name, use_gpu=use_gpu, strategy=cfg.scaling.strategy) or device.type
    return {"model.name": cfg.model.name, "model.gguf_file": cfg.model.gguf_file, "seed": cfg.seed,
            "vocab_size": vocab_size, "dtype": str(dtype).removeprefix("torch."), "init_device": drawn_on}


def load_for_generation(cfg: Config, adapter: Path, recipe: dict, device: torch.device):
    """(model with the adapter, tokenizer) on ``device``, in float32 on a CPU and the run's dtype on a GPU."""
    from raytrain_scu.core.model.build import build_model, resolve_dtype
    from raytrain_scu.core.model.presets import is_preset
    from raytrain_scu.core.model.source import load_tokenizer
    from raytrain_scu.driver.adapters import attach_adapters

    m = cfg.model
    tok = load_tokenizer(m.name, m.gguf_file, m.tokenizer, m.cache_dir)
    dtype = resolve_dtype(m.precision, device)
    init_device = device
    if is_preset(m.name):
        if not recipe:
            raise GenerateError(f"model.name={m.name} is a random-init preset and the run directory has no "
                                f"output/{BASE_RECIPE} saying how its weights were drawn (seed, dtype, device)")
        dtype = getattr(torch, recipe["dtype"])
        init_device = torch.device(recipe["init_device"])
        if init_device.type == "cuda" and not torch.cuda.is_available():
            raise GenerateError(f"the {m.name} preset of this run was initialised on a GPU (seeded CUDA draws); "
                                f"rebuild it on a machine with a CUDA GPU")
    base = build_model(m.name, gguf_file=m.gguf_file, vocab_size=recipe.get("vocab_size") or len(tok), dtype=dtype,
                       device=init_device, attn_implementation="sdpa", cache_dir=m.cache_dir,
                       trust_remote_code=m.trust_remote_code, seed=recipe.get("seed", cfg.seed))
    base = base.to(device=device, dtype=torch.float32 if device.type == "cpu" else dtype)
    base.config.use_cache = True
    model = attach_adapters(base, {"trained": str(adapter)})
    model.eval()
    return model, tok


def trained_on_chat(cfg: Config) -> bool | None:
    """Whether the run trained on conversations: its data.format, or the format its data has (read from the
    source, as training told it); None when the data cannot be read here."""
    from raytrain_scu.core.data.sources import resolve_format, resolve_source
    from raytrain_scu.errors import DataError

    d = cfg.data
    try:
        return resolve_format(resolve_source(d.source, d.path), d.path, d.format, d.text_field) == "chat"
    except DataError:
        return None


def chat_ids(cfg: Config, tok, prompt: str) -> list[int]:
    """``prompt`` as one user turn with the assistant's turn opened, in the template the run trained with
    (data.chat_template, else the tokenizer's own)."""
    from raytrain_scu.core.data.examples import chat_template, read_template
    from raytrain_scu.errors import DataError

    try:
        template = chat_template(tok, read_template(cfg.data.chat_template))
    except DataError as e:
        raise GenerateError(str(e)) from None
    return list(tok.apply_chat_template([{"role": "user", "content": prompt}], chat_template=template,
                                        tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"])


@torch.no_grad()
def complete(model, tok, prompt: str, *, max_new_tokens: int = 60, temperature: float = 0.8, top_p: float = 0.95,
             seed: int = 0, prompt_ids: list[int] | None = None) -> str:
    """The prompt's continuation (sampled when ``temperature`` > 0, greedy at 0); ``prompt_ids``: the prompt
    already tokenized (a chat turn)."""
    device = next(model.parameters()).device
    if prompt_ids is not None:
        ids = torch.tensor([prompt_ids], device=device)
    else:
        ids = tok(prompt, return_tensors="pt")["input_ids"].to(device)
    torch.manual_seed(seed)
    sample = temperature > 0
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=sample, temperature=temperature if sample else None,
                         top_p=top_p if sample else None, pad_token_id=tok.pad_token_id or tok.eos_token_id)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
