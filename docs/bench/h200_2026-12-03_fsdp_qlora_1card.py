"""One GPU: the 4-bit base under ddp (bitsandbytes' codes, torch dequantisation) and under fsdp (ShardedNF4Linear),
eager and compiled, bf16, same seed and data; per step DataBPT, lambda, step time; peak memory. Writes $OUT/q4.json."""
import json, os, sys, time
import torch
import torch.distributed as tdist

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29531")
CPU = not torch.cuda.is_available()  # a dry run of this script here
DEV = torch.device("cpu" if CPU else "cuda")
tdist.init_process_group("gloo" if CPU else "nccl", rank=0, world_size=1)
from raytrain_scu.config.load import load_config
from raytrain_scu.worker.hooks import LocalHooks
from raytrain_scu.worker.loop import setup
from raytrain_scu.worker.step import train_step

STEPS = int(os.environ.get("Q4_STEPS", "12"))
out = {"card": "cpu" if CPU else torch.cuda.get_device_name(0), "torch": torch.__version__}
path = os.path.join(os.environ.get("OUT", "/tmp"), "q4.json")
if not CPU:  # fsdp quantises on rank 0's CPU, ddp / evaluate / generate on the GPU: the same bytes?
    import bitsandbytes.functional as bf
    codes = {}
    for shape in ((4096, 4096), (14336, 4096)):
        w = torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        pc, sc = bf.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
        pg, sg = bf.quantize_4bit(w.cuda(), blocksize=64, compress_statistics=True, quant_type="nf4")
        pg, dq = pg.cpu(), bf.dequantize_4bit(pg, sg).float().cpu()
        codes[str(shape)] = {"codes_equal": torch.equal(pc, pg), "codes_differ_frac": (pc != pg).float().mean().item(),
                             "absmax_q_equal": torch.equal(sc.absmax, sg.absmax.cpu()),
                             "dequant_max_abs_diff": (bf.dequantize_4bit(pc, sc).float() - dq).abs().max().item()}
    out["cpu_vs_cuda_quantisation"] = codes
    print("quant", json.dumps(codes), flush=True)
for compiled in (("false",) if CPU else ("false", "true")):
    for strategy, extra in (("ddp", ["quant.dequant_4bit=torch"]), ("fsdp", [])):
        key = f"{strategy}_compile_{compiled}"
        try:
            cfg = load_config("experiments/tiny-cpu.yaml", [
                f"run.storage_path=/tmp/q4/{key}", "run.name=x", "tracking.enabled=false", f"scaling.use_gpu={str(not CPU).lower()}",
                f"model.precision={'fp32' if CPU else 'bf16'}", f"model.compile={compiled}", "quant.load_in_4bit=true",
                f"scaling.strategy={strategy}", "scaling.num_workers=1", "model.name=tiny-llama-3.1-8b",
                f"train.max_steps={STEPS}", "controller.prior_center=init", "lora.dropout=0.0",
                "data.batch_size=8", "data.block_size=256", "train.eval_every=1000", *extra])
            if not CPU:
                torch.cuda.reset_peak_memory_stats()
            s = setup(cfg, LocalHooks(device=DEV))
            rows, times = [], []
            for step in range(STEPS):
                t = time.perf_counter()
                rows.append(train_step(s, step))
                None if CPU else torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
            out[key] = {"data_bpt": [r["train/data_bpt"] for r in rows], "lam": [r["ctrl/lambda"] for r in rows],
                        "step_s": times, "peak_gib": 0 if CPU else torch.cuda.max_memory_allocated() / 2**30,
                        "sharded": s.opt.sharded, "nf4_layers": sum(type(m).__name__ == "ShardedNF4Linear"
                                                                     for m in s.opt.model.modules())}
        except Exception as e:  # noqa: BLE001 - record and go on to the next arm
            import traceback
            out[key] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
        print(key, json.dumps({k: v for k, v in out[key].items() if k != "trace"})[:800], flush=True)
        json.dump(out, open(path, "w"), indent=1)
tdist.destroy_process_group()
