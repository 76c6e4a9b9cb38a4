"""The benchmark's tiny CPU mode: the same code paths as on a GPU, a table at the end."""
import json
import subprocess
import sys

from conftest import ROOT


def test_bench_smoke_prints_the_table(tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "raytrain_scu.bench", "--smoke", "--out", str(out)],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "| variant | device batch | tokens/s per GPU | MFU | peak mem (GiB) | trained: fixed-set BPT, LoRA B norm |" \
        in r.stdout
    assert "FLOPs/token = 4*N_matmul + 12*L*d*T" in r.stdout and "card: CPU" in r.stdout
    res = json.loads(out.read_text())
    assert set(res["parts"]) == {"attn", "ref_eager", "ours", "scu_none"}
    assert all(p["tokens_per_s"] > 0 for p in res["parts"].values())
    for name in ("ref_eager", "ours", "scu_none"):  # every timed training part proved that it trained
        p = res["parts"][name]
        assert p["lora_b_norm"] > 0 and p["bpt_after"] < p["bpt_before"], (name, p)
    attn = res["parts"]["attn"]  # every SDPA variant computes the same attention as the first one
    timed = {k: v for k, v in attn.items() if isinstance(v, dict) and "ms" in v}
    assert {"auto_bshd", "auto_bhsd", "flash_bshd", "efficient_bshd"} <= set(timed)
    assert all(v["rel_err"] < 1e-4 for v in timed.values()) and attn["fastest"] in timed


def test_mfu_formula_counts_the_llama_1b_shape():
    from raytrain_scu.bench import peak_flops
    from raytrain_scu.model import flops_per_token, matmul_params, preset_config

    c = preset_config("llama-3.2-1b-shape", 128256)
    assert matmul_params(c) == 16 * (2048 * 2048 * 2 + 2 * 2048 * 512 + 3 * 2048 * 8192) + 2048 * 128256
    assert flops_per_token(c, 2048) == 4 * matmul_params(c) + 12 * 16 * 2048 * 2048
    assert peak_flops("NVIDIA H200") == peak_flops("NVIDIA H100 80GB HBM3") == 989e12 and peak_flops("CPU") == 0


def test_a_loop_that_did_not_train_has_no_speed():
    import pytest

    from raytrain_scu.bench import DidNotTrain, proof_of_training

    assert proof_of_training(12.0, 11.5, 0.3)["bpt_after"] == 11.5
    with pytest.raises(DidNotTrain, match="did not train"):
        proof_of_training(5.142265, 5.142265, 0.0)  # issue #14: val to every digit, B never left zero
    with pytest.raises(DidNotTrain):
        proof_of_training(5.0, 5.1, 0.2)
