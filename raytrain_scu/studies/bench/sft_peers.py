"""The supervised fine-tuning bench's peers, on the same examples as our loop (:mod:`.sft_data`) and the same micro-batch
capacity (``batch`` x ``block`` token positions), model, LoRA, bf16 autocast, fused AdamW (lr 1e-4) and timing as the
other peers (:mod:`.reference`):

- :func:`padded_loop`, HF + peft padded as the strongest hand-written loop runs it: length-grouped micro-batches
  (chunks of 512 examples sorted longest first) cut to the longest example rounded up to 64, as many examples a
  micro-batch as fit the capacity; labels -100 on prompts and padding; right padding, so SDPA's causal kernel with no
  mask is exact for every real token (the registered ``causal`` attention); the whole model compiled, the sequence
  dimension marked dynamic (one graph for every length);
- :func:`trl_loop`, TRL's ``SFTTrainer`` (pip ``trl``) with ``padding_free=True`` and its best-fit-decreasing packing
  (``packing_strategy="bfd"``, ``max_length=block``, ``per_device_train_batch_size=batch``: rows of at most
  ``block`` tokens, flattened into one sequence with its position ids), the loss on completions only, the examples
  given tokenised (``input_ids`` and ``completion_mask``). Without flash-attn on the machine, transformers finds the
  examples from the position ids and masks attention between them (``attention`` names the implementation:
  ``flex_attention`` or ``sdpa``); TRL's loss is its own fused LM head (Triton kernels, CUDA only); uncompiled.

Every part reports the tokens it processed a second (prompts and answers, never padding) and its target (answer)
tokens a second, medians over intervals of ``interval`` steps after ``warmup`` steps, synchronised at their ends."""
from __future__ import annotations

import importlib.util
import math
import statistics
import tempfile
import time

import numpy as np
import torch

from raytrain_scu.core.data.batches import PAD_MULTIPLE
from raytrain_scu.core.regularizer import lora_b_norm
from raytrain_scu.studies.bench.measure import free, peak_mem, peak_reserved, proof_of_training, reset_mem, sync
from raytrain_scu.studies.bench.reference import peer_model
from raytrain_scu.studies.bench.unsloth import PartSkipped

IGNORE = -100


def padded_batches(examples, *, capacity: int, count: int, seed: int, pad_id: int, multiple: int = PAD_MULTIPLE,
                   group: int = 512) -> list[tuple[torch.Tensor, torch.Tensor, int, int]]:
    """``count`` micro-batches (inputs, labels, tokens, targets) of ``examples`` ((ids, target) pairs), length-grouped
    (chunks of ``group`` examples sorted longest first) and cut to ``capacity`` token positions each (an example wider
    than the capacity alone in its micro-batch); the stream starts over when it runs out."""
    rng = np.random.default_rng(seed)
    out: list = []
    while len(out) < count:
        order = rng.permutation(len(examples))
        batches = []
        for start in range(0, len(order), group):
            chunk = sorted(order[start:start + group], key=lambda i: -len(examples[i][0]))
            while chunk:
                width = multiple * math.ceil(len(examples[chunk[0]][0]) / multiple)
                n = max(1, min(len(chunk), capacity // width))
                batches.append(_pad([examples[i] for i in chunk[:n]], width, pad_id))
                chunk = chunk[n:]
        out += [batches[i] for i in rng.permutation(len(batches))]
    return out[:count]


def _pad(rows, width: int, pad_id: int):
    x = torch.full((len(rows), width), pad_id, dtype=torch.long)
    y = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    for r, (ids, target) in enumerate(rows):
        x[r, :len(ids)] = torch.tensor(ids)
        y[r, :len(ids)] = torch.where(torch.tensor(target), torch.tensor(ids), IGNORE)
    if torch.cuda.is_available():
        x, y = x.pin_memory(), y.pin_memory()
    return x, y, sum(len(ids) for ids, _ in rows), int((y[:, 1:] != IGNORE).sum())


def interval_rates(ends: list[tuple[int, float]], counts: list[tuple[int, int]]) -> tuple[list[float], list[float]]:
    """(tokens/s, target tokens/s) of each interval between consecutive (micro-batches so far, time) marks;
    ``counts[i]`` holds micro-batch ``i + 1``'s (tokens, targets)."""
    tok, tgt = [], []
    for (s0, t0), (s1, t1) in zip(ends, ends[1:]):
        tok.append(sum(c[0] for c in counts[s0:s1]) / (t1 - t0))
        tgt.append(sum(c[1] for c in counts[s0:s1]) / (t1 - t0))
    return tok, tgt


def _bpt(model, x, y, dev, dtype) -> float:
    with torch.no_grad(), torch.autocast(dev.type, dtype=dtype, enabled=dev.type == "cuda"):
        return model(input_ids=x.to(dev), labels=y.to(dev)).loss.item() / math.log(2.0)


def _result(tok, tgt, counts, proof, **kw) -> dict:
    return {"tokens_per_s": statistics.median(tok), "target_tokens_per_s": statistics.median(tgt),
            "peak_mem_gib": peak_mem(), "peak_reserved_gib": peak_reserved(),
            "tokens_per_step": round(statistics.mean(c[0] for c in counts)),
            "interval_tokens_per_s": [round(r) for r in tok], **proof, **kw}


def padded_loop(*, preset: str, examples, batch: int, block: int, steps: int, warmup: int, interval: int,
                compile_: bool, pad_id: int) -> dict:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = peer_model(preset, dev=dev, dtype=dtype, attention="causal", lora_r=16)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=dev.type == "cuda")
    step_fn = torch.compile(model) if compile_ else model
    batches = padded_batches(examples, capacity=batch * block, count=warmup + steps, seed=0, pad_id=pad_id)
    fixed = batches[0]
    bpt_before = _bpt(model, fixed[0], fixed[1], dev, dtype)
    reset_mem()
    ends = []
    for i, (x, y, _, _) in enumerate(batches):
        if i >= warmup and (i - warmup) % interval == 0:
            sync()
            ends.append((i, time.perf_counter()))
        x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
        torch._dynamo.mark_dynamic(x, 1)
        torch._dynamo.mark_dynamic(y, 1)
        with torch.autocast(dev.type, dtype=dtype, enabled=dev.type == "cuda"):
            loss = step_fn(input_ids=x, labels=y).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    sync()
    ends.append((len(batches), time.perf_counter()))
    counts = [(b[2], b[3]) for b in batches]
    tok, tgt = interval_rates(ends, counts)
    proof = proof_of_training(bpt_before, _bpt(model, fixed[0], fixed[1], dev, dtype), lora_b_norm(model).item())
    out = _result(tok, tgt, counts, proof, batch=f"<= {batch * block} positions", attention="causal",
                  compile_scope="model" if compile_ else "none",
                  examples_per_step=round(statistics.mean(len(b[0]) for b in batches), 1))
    del model, opt, step_fn
    free()
    return out


def trl_loop(*, preset: str, examples, tokenizer, batch: int, block: int, steps: int, warmup: int, interval: int,
             attention: str, compile_: bool = False) -> dict:
    """TRL's trainer as its users run it, uncompiled; ``compile_``: the Trainer's ``torch_compile=True``, under which
    Inductor fails to compile TRL's own Triton kernel of the fused LM head (``_forward_kernel``; torch 2.11, trl 1.15
    on an H200: docs/bench/h200_2026-12-02_sft_trl_compiled_1b.json), kept as the part ``sft_ref_trl_compiled``."""
    if not torch.cuda.is_available():
        raise PartSkipped("CUDA only: TRL's SFTTrainer computes its loss with Triton kernels, and FlexAttention has no "
                          "backward on the CPU")
    if importlib.util.find_spec("trl") is None:
        raise PartSkipped("trl is not installed (pip install trl==1.15.0)")
    dev, dtype = torch.device("cuda"), torch.bfloat16
    model = peer_model(preset, dev=dev, dtype=dtype, attention=attention, lora_r=16)
    out = sft_trainer_run(model, examples=examples, tokenizer=tokenizer, batch=batch, block=block, steps=steps,
                          warmup=warmup, interval=interval, compile_=compile_)
    import trl

    out.update(attention=attention, compile_scope="model (Trainer torch_compile)" if compile_ else "none",
               trl=trl.__version__)
    del model
    free()
    return out


def sft_trainer_run(model, *, examples, tokenizer, batch: int, block: int, steps: int, warmup: int, interval: int,
                    compile_: bool = False) -> dict:
    """``model`` (a peft LoRA model on the GPU) trained by ``trl.SFTTrainer`` on ``examples``: padding-free with
    best-fit-decreasing packing into rows of ``block`` tokens, ``batch`` rows a micro-batch, the loss on completions
    only, fused AdamW lr 1e-4, bf16, timed by a callback at the ends of the intervals; the part's result (without
    what names the model's setup). Whatever ``trl.SFTTrainer`` is when called: TRL's own, or the class Unsloth puts
    in its place when it is imported first (:mod:`.unsloth_child`)."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    dev, dtype = torch.device("cuda"), torch.bfloat16
    data = Dataset.from_dict({"input_ids": [ids for ids, _ in examples],
                              "completion_mask": [[int(t) for t in target] for _, target in examples]})
    counts, ends = [], []

    class Counted(SFTTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            counts.append((inputs["input_ids"].numel(), (inputs["labels"] != IGNORE).sum()))
            return super().training_step(model, inputs, num_items_in_batch)

    class Clock(TrainerCallback):  # marks (micro-batches so far, time): counts[i] is micro-batch i + 1's
        def on_step_end(self, args, state, control, **kw):
            k = state.global_step - warmup
            if k >= 0 and (k % interval == 0 or state.global_step == warmup + steps):
                sync()
                ends.append((len(counts), time.perf_counter()))

    fixed = padded_batches(examples[:4], capacity=4 * block, count=1, seed=0,
                           pad_id=tokenizer.eos_token_id or 0)[0]
    bpt_before = _bpt(model, fixed[0], fixed[1], dev, dtype)
    with tempfile.TemporaryDirectory() as tmp:
        # one micro-batch a step, said explicitly: Unsloth's SFTConfig defaults to two
        cfg = SFTConfig(output_dir=tmp, max_steps=warmup + steps, per_device_train_batch_size=batch,
                        gradient_accumulation_steps=1,
                        learning_rate=1e-4, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                        optim="adamw_torch_fused", bf16=True,
                        gradient_checkpointing=False, packing=True, packing_strategy="bfd", padding_free=True,
                        max_length=block, completion_only_loss=True, logging_strategy="no", save_strategy="no",
                        eval_strategy="no", report_to="none", torch_compile=compile_, seed=0, disable_tqdm=True,
                        dataloader_pin_memory=True)
        trainer = Counted(model=model, args=cfg, train_dataset=data, processing_class=tokenizer, callbacks=[Clock()])
        reset_mem()
        trainer.train()
    counts = [(int(n), int(t)) for n, t in counts]
    tok, tgt = interval_rates(ends, counts)
    proof = proof_of_training(bpt_before, _bpt(model, fixed[0], fixed[1], dev, dtype), lora_b_norm(model).item())
    out = _result(tok, tgt, counts, proof, batch=f"{batch} x {block}", trainer=type(trainer).__mro__[1].__name__)
    del trainer
    free()
    return out
