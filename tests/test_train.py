"""Integration: the real training engine on Ray with CPU workers (gloo), the tiny model, real checkpoints."""
import json

import pytest
import torch
from conftest import in_process, tiny_cfg
from safetensors.torch import load_file

from raytrain_scu.driver.run import run
from raytrain_scu.ray.launch import build_trainer

pytestmark = pytest.mark.slow


def history_of(summary):
    """The per-step control trace of the final checkpoint."""
    import glob

    last = sorted(glob.glob(f"{summary['run_dir']}/checkpoint_0*"))[-1]
    return torch.load(f"{last}/state.pt", weights_only=False)["history"]


def test_ranks_agree_on_lambda_and_s_every_step(ray_local, tmp_path):
    from ray.train import UserCallback

    out = tmp_path / "reports.jsonl"

    class Collect(UserCallback):
        def after_report(self, run_context, metrics, checkpoint):
            with open(out, "a") as f:
                f.write(json.dumps([{k: m[k] for k in ("step", "ctrl/lambda", "ctrl/s", "ctrl/s_hat",
                                                       "perf/report_wait_s")} for m in metrics]) + "\n")

    # S* near the tiny run's S: far from it, the logodds law (the default) holds λ while the error closes
    cfg = tiny_cfg(tmp_path, "ranks", "train.max_steps=8", "train.report_every=1", "train.checkpoint_every=4",
                   "tracking.enabled=false", "controller.target_s=0.2")
    assert cfg.scaling.num_workers == 2
    result = build_trainer(cfg, use_gpu=False, run_id=None, callbacks=[Collect()]).fit()
    assert result.error is None
    # the run's actors: no Ray Data DatasetManager (launch.Trainer leaves Ray Data's callback out)
    from ray.util.state import list_actors

    assert not list_actors(address=ray_local.get_runtime_context().gcs_address, raise_on_missing_output=False,
                           filters=[("class_name", "=", "DatasetManager")])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r[0]["step"] for r in rows] == list(range(1, 9))
    for per_rank in rows:
        assert len(per_rank) == 2
        ctrl = [{k: v for k, v in m.items() if k != "perf/report_wait_s"} for m in per_rank]
        assert ctrl[0] == ctrl[1]                  # bit-identical on both ranks
    assert len({r[0]["ctrl/lambda"] for r in rows}) > 1  # and the controller did move λ
    # a worker holds one unconsumed report: at Ray's default 2 s poll a report per step would wait ~2 s from the
    # third on; build_trainer sets the controller's poll to scaling.poll_interval_s (0.25 s)
    import os
    import statistics

    assert os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == str(cfg.scaling.poll_interval_s)
    # each report carries the previous report's wait: leave out those that follow a checkpoint report (steps 4, 8)
    waits = [r[0]["perf/report_wait_s"] for r in rows[3:] if r[0]["step"] % 4 != 1]
    assert statistics.median(waits) < 1.0, waits


# with LoRA dropout on, so a resumed run must also go on with every rank's own RNG stream where it stopped; the
# last step's adapter is the run's output (run.primary_adapter=last), so the resumed run's end is compared
RESUME_COMMON = ["tracking.enabled=false", "lora.dropout=0.1", "run.primary_adapter=last"]


@pytest.fixture(scope="module")
def finished_run(ray_local, tmp_path_factory):
    """(config, summary) of one finished, uninterrupted 20-step run (tiny-cpu.yaml's 2 workers, no MLflow): the
    resume test compares against it, the tests below only read it or re-run its name, which returns before Ray."""
    cfg = tiny_cfg(tmp_path_factory.mktemp("full"), "full", *RESUME_COMMON)
    return cfg, run(cfg)


def test_resume_by_rerunning_same_name_matches_uninterrupted(finished_run, tmp_path, monkeypatch):
    common = RESUME_COMMON
    full = finished_run[1]
    monkeypatch.setenv("RAYTRAIN_SCU_FAULT_AT_STEP", "13")
    with pytest.raises(Exception, match="fault injected after step 13"):
        run(tiny_cfg(tmp_path, "cut", *common, "run.max_failures=0"), quiet=True)
    monkeypatch.delenv("RAYTRAIN_SCU_FAULT_AT_STEP")
    # the checkpoint holds both ranks' RNG, and they differ: the ranks drew distinct dropout masks
    rngs = torch.load(tmp_path / "cut" / "checkpoint_00000010" / "state.pt", weights_only=False)["rng"]
    assert len(rngs) == 2 and not torch.equal(rngs[0]["torch"], rngs[1]["torch"])
    # changed data (a different tokens_per_epoch) is refused by the loop itself when it opens the checkpoint, past
    # the driver's preflight (whose refusal test_reliability's ..._changed_data_is_refused_before_ray proves): the
    # check is the worker's own, so the loop runs here in this process on the cut run's checkpoints
    from raytrain_scu.worker.hooks import LocalHooks
    from raytrain_scu.worker.loop import run_loop

    changed = tiny_cfg(tmp_path, "cut", *common, "data.max_documents=5", "run.max_failures=0")
    with pytest.raises(Exception, match="the checkpoint was written with tokens_per_epoch=204544 but the data now "
                       "gives tokens_per_epoch=140416"):
        run_loop(changed, hooks=LocalHooks(device=torch.device("cpu"), run_dir=tmp_path / "cut"))
    resumed = run(tiny_cfg(tmp_path, "cut", *common), quiet=True)
    a, b = history_of(full), history_of(resumed)
    assert [r["step"] for r in b] == list(range(0, 21))
    for ra, rb in zip(a[11:], b[11:]):            # steps 11..20 ran after the resume
        for k in ("train/data_bpt", "ctrl/lambda", "ctrl/s", "ctrl/s_hat", "train/param_bpt"):
            assert rb[k] == ra[k], (ra["step"], k)
    adapters = [load_file(f"{s['adapter']}/adapter_model.safetensors") for s in (full, resumed)]
    assert adapters[0].keys() == adapters[1].keys()
    assert all(torch.equal(adapters[0][k], adapters[1][k]) for k in adapters[0])  # bitwise


def test_fixed_large_lambda_shrinks_adapter(tmp_path):
    """The penalty reaches the adapters: a large fixed λ leaves Σw² (ParamBPT, at one N) under 0.64 of no penalty's,
    an adapter norm under 0.8 of it."""
    common = ["tracking.enabled=false", "scaling.num_workers=1", "train.max_steps=15", "optim.lr=0.01",
              "train.checkpoint_every=15", "controller.tokens_per_epoch=2000"]
    none = in_process(tiny_cfg(tmp_path, "none", "controller.mode=none", *common))
    fixed = in_process(tiny_cfg(tmp_path, "fixed", "controller.mode=fixed", "controller.lambda_init=10", *common))
    assert none["step"] == fixed["step"] == 15
    assert fixed["train/param_bpt"] < 0.64 * none["train/param_bpt"]
    assert none["ctrl/lambda"] == 0.0 and fixed["ctrl/lambda"] == 10.0


def test_exported_adapter_loads_with_peft(finished_run):
    from peft import PeftModel

    from raytrain_scu.core.model.build import build_model
    from raytrain_scu.core.model.source import load_tokenizer

    s = finished_run[1]
    tok = load_tokenizer("tiny")
    model = PeftModel.from_pretrained(build_model("tiny", vocab_size=len(tok)), s["adapter"])
    assert any("lora_A" in n for n, _ in model.named_parameters())
    assert json.loads(open(f"{s['adapter']}/adapter_config.json").read())["r"] == 4


def test_finished_run_is_reported_before_ray_and_its_adapter_generates(finished_run, tmp_path, capsys):
    """Re-running a finished run prints its summary within seconds, without Ray; generate rebuilds the base model from
    the run directory (a preset: base_model.json's seed, dtype and device) and completes a prompt with the adapter."""
    import time

    cfg, first = finished_run
    storage = cfg.run.storage_path
    capsys.readouterr()
    t0 = time.perf_counter()
    again = run(cfg)
    assert time.perf_counter() - t0 < 5.0 and again == json.loads(json.dumps(first, default=str))
    out = capsys.readouterr().out
    assert "run full already finished at step 20" in out and "held-out BPT" in out
    recipe = json.loads(open(f"{storage}/full/output/base_model.json").read())
    assert recipe["init_device"] == "cpu" and recipe["dtype"] == "float32" and recipe["seed"] == cfg.seed
    from raytrain_scu.cli.generate import main as generate_main  # the CLI in this process: it starts no Ray

    code = generate_main([f"{storage}/full", "To be, or not", "--max-new-tokens", "8", "--temperature", "0"])
    out, err = capsys.readouterr()
    assert code == 0, err[-2000:]
    assert out.startswith("To be, or not") and len(out.strip()) > len("To be, or not")
    assert generate_main([f"{tmp_path}/nothing", "x"]) == 2
    assert "run directory not found" in capsys.readouterr().err


def test_qlora_4bit_runs_on_cpu(tmp_path):
    last = in_process(tiny_cfg(tmp_path, "qlora", "tracking.enabled=false", "scaling.num_workers=1",
                               "quant.load_in_4bit=true", "train.max_steps=4", "train.report_every=2",
                               "train.checkpoint_every=4"))
    assert last["step"] == 4 and last["val/data_bpt"] == last["val/data_bpt"] and last["train/lora_b_norm"] > 0


@pytest.mark.parametrize("dequant", ["auto", "bitsandbytes"])
def test_qlora_4bit_compiled_trains_on_cpu_and_preflight_wants_a_bitsandbytes_that_compiles(tmp_path, dequant):
    """quant.load_in_4bit with model.compile: each decoder layer compiled over the 4-bit layers, their weights
    dequantised by torch ops in the layers' graphs (quant.dequant_4bit=auto) or by bitsandbytes' ops, with
    checkpointing, as the 8B QLoRA bench parts run, trains; preflight passes the bitsandbytes installed here and
    refuses an older one by name."""
    from raytrain_scu.driver.preflight import check_4bit_compiles, preflight
    from raytrain_scu.errors import PreflightError

    cfg = tiny_cfg(tmp_path, "qlora-compiled", "tracking.enabled=false", "scaling.num_workers=1",
                   "model.name=tiny-llama-3.1-8b", "model.precision=bf16", "quant.load_in_4bit=true",
                   "model.compile=true", "model.gradient_checkpointing=true", "train.max_steps=4",
                   "train.report_every=2", "train.checkpoint_every=4", "controller.mode=none",
                   f"quant.dequant_4bit={dequant}")
    preflight(cfg)
    with pytest.raises(PreflightError, match=r"needs bitsandbytes >= 0.50 .* found 0.45.5: pip install -U"):
        check_4bit_compiles("0.45.5")
    last = in_process(cfg)
    assert last["step"] == 4 and last["train/lora_b_norm"] > 0 and last["val/data_bpt"] < last["val/data_bpt_start"]


def test_cli_rejects_bad_config_before_ray(tmp_path, capsys, monkeypatch):
    """The CLI's main in this process: exit 2 naming the key, before anything reaches for Ray (an init_ray that
    raises would turn the exit into a traceback)."""
    from conftest import TINY

    from raytrain_scu.cli.train import main
    from raytrain_scu.ray import launch

    def no_ray(*args, **kwargs):
        raise AssertionError("the bad config reached init_ray")

    monkeypatch.setattr(launch, "init_ray", no_ray)
    assert main([TINY, "controller.target_s=1.5", f"run.storage_path={tmp_path}"]) == 2
    out = capsys.readouterr()
    assert "controller.target_s" in out.err
    assert "starting a local Ray" not in out.out and "joining the Ray cluster" not in out.out


def test_loop_logs_mfu_where_the_card_peak_is_known_and_leaves_it_out_elsewhere(tmp_path, monkeypatch, capfd):
    """The loop in this process (no Ray needed): with the peak of an H100 looked up for its device, every report
    and the MLflow run carry perf/mfu = tokens/s per GPU x FLOPs/token / peak; on this CPU there is no peak, so no
    perf/mfu at all (not 0) and one line that says so."""
    from conftest import mlflow_runs

    from raytrain_scu.core.model.flops import flops_per_token
    from raytrain_scu.core.model.presets import preset_config
    from raytrain_scu.core.model.source import load_tokenizer
    from raytrain_scu.worker import loop
    from raytrain_scu.worker.hooks import LocalHooks

    common = ["scaling.num_workers=1", "train.max_steps=4", "train.report_every=2", "train.checkpoint_every=4"]
    fpt = flops_per_token(preset_config("tiny", len(load_tokenizer("tiny"))), 64)  # tiny-cpu.yaml: block 64
    cpu = LocalHooks(device=torch.device("cpu"))
    loop.run_loop(tiny_cfg(tmp_path, "no_peak", "tracking.enabled=false", *common), hooks=cpu)
    assert len(cpu.reports) == 2 and all("perf/tokens_per_s" in r and "perf/mfu" not in r for r in cpu.reports)
    assert all(r["perf/max_reserved_gib"] == 0 for r in cpu.reports)
    assert capfd.readouterr().out.count("perf/mfu is not logged: no dense bf16 peak FLOP/s is known for cpu") == 1

    monkeypatch.setattr(loop, "device_peak_flops", lambda device: 989e12)  # as on an H100
    hooks = LocalHooks(device=torch.device("cpu"))
    loop.run_loop(tiny_cfg(tmp_path, "peak", *common), hooks=hooks)
    assert [r["step"] for r in hooks.reports] == [2, 4]
    for r in hooks.reports:
        assert r["perf/mfu"] == pytest.approx(r["perf/tokens_per_s"] * fpt / 989e12, rel=1e-12) and r["perf/mfu"] > 0
    client, runs = mlflow_runs(tmp_path, "peak")
    logged = client.get_metric_history(runs[0].info.run_id, "perf/mfu")
    assert sorted((m.step, m.value) for m in logged) == [(r["step"], r["perf/mfu"]) for r in hooks.reports]


@pytest.mark.slow
def test_more_workers_than_the_joined_cluster_has_are_refused_before_any_starts(ray_local, tmp_path, capsys):
    """With Ray already up (a cluster joined), preflight cannot count the machine's CPUs: the driver checks the
    cluster's resources once it has joined, instead of letting Ray Train wait for workers it can never place."""
    import time

    from conftest import TINY

    from raytrain_scu.cli.train import main

    cpus = int(ray_local.cluster_resources()["CPU"])
    t0 = time.time()
    code = main([TINY, f"scaling.num_workers={cpus}", "scaling.cpus_per_worker=2", f"run.storage_path={tmp_path}",
                 "run.name=toobig", "tracking.enabled=false"])
    assert code == 2 and time.time() - t0 < 30  # Ray Train's start-up timeout alone is 60 s
    assert f"scaling.num_workers={cpus}: {cpus} workers x 2 CPU need {2 * cpus} CPUs, but the Ray cluster has {cpus}" \
        in capsys.readouterr().err


def test_summarize_downloads_each_remote_checkpoint_once(tmp_path, monkeypatch):
    """The last checkpoint gives adapter_last/ and the trace, the best one adapter/: each is read from the
    storage once (a pyarrow filesystem that is not the local one: Ray's Checkpoint.as_directory downloads it)."""
    import types

    import pyarrow.fs as pafs
    from ray.train import Checkpoint

    from raytrain_scu.core.checkpoint import BEST_METRIC
    from raytrain_scu.driver.run import summarize
    from raytrain_scu.worker.hooks import LocalHooks
    from raytrain_scu.worker.loop import run_loop

    cfg = tiny_cfg(tmp_path, "dl", "tracking.enabled=false", "train.max_steps=4", "train.checkpoint_every=2",
                   "train.report_every=2", "train.eval_every=2")
    run_loop(cfg, hooks=LocalHooks(device=torch.device("cpu"), run_dir=tmp_path / "ckpts"))
    remote = pafs.SubTreeFileSystem(str(tmp_path / "ckpts"), pafs.LocalFileSystem())
    ck2, ck4 = (Checkpoint(path=f"checkpoint_0000000{s}", filesystem=remote) for s in (2, 4))
    downloads = []
    to_directory = Checkpoint.to_directory
    monkeypatch.setattr(Checkpoint, "to_directory", lambda self, *a: downloads.append(self.path) or
                        to_directory(self, *a))
    result = types.SimpleNamespace(metrics={"step": 4}, checkpoint=ck4,
                                   best_checkpoints=[(ck2, {BEST_METRIC: 1.0, "step": 2}),
                                                     (ck4, {BEST_METRIC: 2.0, "step": 4})])
    summary = summarize(cfg, result, None, {}, [], {"use_gpu": False, "vocab_size": 100})
    assert sorted(downloads) == [ck2.path, ck4.path]
    assert summary["best_step"] == 2 and summary["last_adapter"].endswith("adapter_last") and summary["plots"]
