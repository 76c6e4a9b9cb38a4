"""Config: YAML -> overrides -> strict build -> cross-field checks; errors name the key."""
import glob
import subprocess
import sys

import pytest
import yaml
from conftest import ROOT, TINY

from raytrain_scu.config.io import flatten, to_yaml
from raytrain_scu.config.load import load_config
from raytrain_scu.config.schema import Config
from raytrain_scu.errors import ConfigError

REQUIRED_KEYS = ["scaling.num_workers", "scaling.use_gpu", "train.max_steps", "train.checkpoint_every",
                 "train.report_every", "run.name", "run.storage_path", "run.max_failures", "tracking.uri", "data.path",
                 "controller.mode", "controller.target_s", "controller.kp", "controller.ki", "data.batch_size",
                 "optim.lr", "seed"]


@pytest.mark.parametrize("path", sorted(glob.glob(str(ROOT / "experiments" / "*.yaml"))))
def test_every_experiment_loads(path):
    from raytrain_scu.config.io import explicit_keys, load_raw
    from raytrain_scu.config.law_keys import check_law_keys

    cfg = load_config(path)
    assert isinstance(cfg, Config) and cfg.run.name
    assert open(path).readline().startswith("# Launch:")
    check_law_keys(cfg, explicit_keys(load_raw(path)))  # no key of a law that no run of it uses


def test_required_key_names_exist():
    flat = flatten(Config())
    for key in REQUIRED_KEYS:
        assert key in flat, key


def test_overrides_are_typed_by_field():
    cfg = load_config(TINY, ["train.max_steps=200", "controller.mode=fixed", "lora.target_modules=q_proj,v_proj",
                             "optim.lr=1e-3", "scaling.use_gpu=auto", "model.compile=true"])
    assert cfg.train.max_steps == 200 and cfg.controller.mode == "fixed"
    assert cfg.lora.target_modules == ["q_proj", "v_proj"] and cfg.optim.lr == 1e-3
    assert cfg.scaling.use_gpu is None and cfg.model.compile is True
    assert cfg.run.name == "tiny-cpu"   # defaults to the config file's stem


@pytest.mark.parametrize("override,key", [
    ("train.max_stepz=3", "train.max_stepz"),
    ("nosuch.section=1", "nosuch"),
    ("train.max_steps=abc", "train.max_steps"),
    ("train.max_steps=2.5", "train.max_steps"),
    ("model.compile=maybe", "model.compile"),
    ("optim.lr=-1", "optim.lr"),
    ("controller.target_s=0", "controller.target_s"),
    ("controller.target_s=1", "controller.target_s"),
    ("controller.kp=-0.1", "controller.kp"),
    ("controller.ki=-0.1", "controller.ki"),
    ("controller.lambda_min=2", "controller.lambda_init"),
    ("controller.lambda_max=0.5", "controller.lambda_init"),
    ("controller.mode=pid", "controller.mode"),
    ("data.batch_size=0", "data.batch_size"),
    ("data.block_size=1", "data.block_size"),
    ("data.val_fraction=1.0", "data.val_fraction"),
    ("data.source=csv", "data.source"),
    ("scaling.num_workers=0", "scaling.num_workers"),
    ("scaling.poll_interval_s=0", "scaling.poll_interval_s"),
    ("train.checkpoint_every=7", "train.checkpoint_every"),
    ("model.precision=fp8", "model.precision"),
    ("model.recompute_elementwise=true", "model.recompute_elementwise"),
    ("tracking.uri=file:///tmp/mlruns", "tracking.uri"),
    ("run.name=a/b", "run.name"),
    ("lora.r=0", "lora.r"),
    ("hardware.preset=v100", "hardware.preset"),
    ("tune.search=bayes", "tune.search"),
    ("train.eval_blocks=-1", "train.eval_blocks"),
    ("train.profile_steps=-1", "train.profile_steps"),
    ("train.preempt_grace_s=0", "train.preempt_grace_s"),
])
def test_bad_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(TINY, [override])


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_cuda_graph_modes_need_the_whole_model_compiled_on_a_gpu(mode):
    gpu = ["model.compile=true", f"model.compile_mode={mode}", "scaling.use_gpu=true"]
    with pytest.raises(ConfigError, match=rf"model\.compile_mode: {mode} replays CUDA graphs, which needs "
                                          rf"model\.compile_scope=model on a GPU"):
        load_config(TINY, gpu)
    with pytest.raises(ConfigError, match=r"model\.compile_mode"):  # auto-detect may find a GPU
        load_config(TINY, [*gpu[:2], "scaling.use_gpu=null"])
    assert load_config(TINY, [*gpu, "model.compile_scope=model"]).model.compile_mode == mode
    assert load_config(TINY, [*gpu[:2], "scaling.use_gpu=false"]).model.compile_scope == "layers"  # no graphs on CPUs
    assert load_config(TINY, [gpu[0], "model.compile_mode=max-autotune-no-cudagraphs", gpu[2]]).model.compile


def test_a_profile_needs_a_local_run_directory():
    assert load_config(TINY, ["train.profile_steps=3"]).train.profile_steps == 3
    with pytest.raises(ConfigError, match=r"train\.profile_steps: .*must be a local path, not 's3://bucket/runs'"):
        load_config(TINY, ["train.profile_steps=3", "run.storage_path=s3://bucket/runs"])


def test_a_profile_of_the_device_alone_needs_a_gpu():
    on = ["train.profile_steps=3", "train.profile_host=false"]
    assert not load_config(TINY, [*on, "scaling.use_gpu=null"]).train.profile_host
    assert not load_config(TINY, ["train.profile_host=false"]).train.profile_host  # no profile: nothing to refuse
    with pytest.raises(ConfigError, match=r"train\.profile_host: false records the GPU's kernels alone and needs a "
                                          r"GPU, not scaling\.use_gpu=false"):
        load_config(TINY, on)  # tiny-cpu.yaml: scaling.use_gpu=false


def test_a_remote_output_dir_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"run\.output_dir: must be a local path, not 's3://bucket/out': for output "
                       r"on remote storage leave it empty and set run\.storage_path"):
        load_config(TINY, ["run.output_dir=s3://bucket/out"])


def test_a_fixed_lambda_may_lie_outside_the_scu_bounds():
    assert load_config(TINY, ["controller.mode=fixed", "controller.lambda_init=1e-6"]).controller.lambda_init == 1e-6
    with pytest.raises(ConfigError, match=r"controller\.lambda_init"):
        load_config(TINY, ["controller.mode=fixed", "controller.lambda_init=0"])


def test_removed_eval_batches_names_its_replacement(tmp_path):
    # eval_batches scored batches x batch_size x workers blocks; its replacement is a fixed number of blocks
    removed = r"'train\.eval_batches' was removed: use train\.eval_blocks"
    with pytest.raises(ConfigError, match=removed):
        load_config(TINY, ["train.eval_batches=4"])
    p = tmp_path / "old.yaml"
    p.write_text("train:\n  eval_batches: 4\n")
    with pytest.raises(ConfigError, match=removed):
        load_config(p)
    p.write_text(yaml.safe_dump({"tune": {"space": {"train.eval_batches": {"choice": [1, 2]}}}}))
    with pytest.raises(ConfigError, match=r"tune\.space\.train\.eval_batches: 'train\.eval_batches' was removed"):
        load_config(p)
    assert load_config(TINY, ["train.eval_blocks=7"]).train.eval_blocks == 7


def test_unknown_and_mistyped_keys_in_yaml(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  max_steps: 10\n  bogus: 1\n")
    with pytest.raises(ConfigError, match=r"train\.bogus"):
        load_config(p)
    p.write_text("data:\n  batch_size: [1, 2]\n")
    with pytest.raises(ConfigError, match=r"data\.batch_size.*int"):
        load_config(p)
    p.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(p)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")


@pytest.mark.parametrize("space,needle", [
    ({"controller.kp": {"loguniform": [0, 1]}}, "low > 0"),
    ({"controller.kp": {"uniform": [2, 1]}}, "low < high"),
    ({"controller.kq": {"choice": [1]}}, "not a config key"),
    ({"controller.kp": {"normal": [0, 1]}}, "unknown kind"),
    ({"data.batch_size": {"choice": ["big"]}}, "int"),
    ({"controller.mode": {"uniform": [0, 1]}}, "numeric"),
])
def test_malformed_search_space(tmp_path, space, needle):
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump({"tune": {"space": space}}))
    with pytest.raises(ConfigError, match=needle):
        load_config(p)


def test_yaml_round_trip_and_cli(tmp_path):
    cfg = load_config(TINY, ["controller.logodds_kp=1.5"])
    p = tmp_path / "resolved.yaml"
    p.write_text(to_yaml(cfg))
    assert load_config(p) == cfg
    r = subprocess.run([sys.executable, "-m", "raytrain_scu.config", TINY, "controller.logodds_kp=1.5"],
                       capture_output=True, text=True)
    assert r.returncode == 0 and yaml.safe_load(r.stdout)["controller"]["logodds_kp"] == 1.5
    r = subprocess.run([sys.executable, "-m", "raytrain_scu.config", TINY, "controller.kq=0.5"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "controller.kq" in r.stderr


@pytest.mark.parametrize("override, env", [
    ("tracking.uri=https://alice:pwSECRET1@mlflow.example.com", "MLFLOW_TRACKING_PASSWORD"),
    ("tracking.uri=postgresql://alice:pgSECRET2@db.example.com/mlflow", "PGPASSWORD"),
    ("run.storage_path=s3://AKIDEXAMPLE:awsSECRET3@runs/x?endpoint_override=http://127.0.0.1:9000", "AWS_SECRET_ACCESS_KEY"),
    ("run.storage_path=s3://runs/x?endpoint_override=http://minio:epSECRET4@127.0.0.1:9000", "AWS_SECRET_ACCESS_KEY"),
    ("run.storage_path=s3://runs/x?endpoint_override=http://127.0.0.1:9000&secret_key=qSECRET5", "AWS_SECRET_ACCESS_KEY"),
    ("run.storage_path=s3://runs/x?endpoint_override=http://127.0.0.1:9000&passwd=pwSECRET9", "AWS_SECRET_ACCESS_KEY"),
    ("model.name=hf_SECRET6abcdefghijklmnopqrstuvwxyz0123", "HF_TOKEN"),
    ("tracking.password=keySECRET7", "MLFLOW_TRACKING_PASSWORD"),  # no such key: one named like a secret
    ("run.aws_secret_access_key=keySECRET8", "AWS_SECRET_ACCESS_KEY"),
])
def test_a_credential_in_the_config_is_refused_naming_the_environment_variable(override, env):
    key = override.split("=", 1)[0]
    secret = next(w for w in override.replace("@", " ").replace("&", " ").replace("=", " ").replace(":", " ").split()
                  if "SECRET" in w)
    with pytest.raises(ConfigError) as e:
        load_config(TINY, [override])
    message = str(e.value)
    assert message.startswith(f"{key}: ") and env in message and "in the environment" in message, message
    assert secret not in message  # the refusal does not repeat the credential


def test_a_secret_key_in_the_config_file_is_refused_and_lookalikes_are_not(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("tracking:\n  password: hunter2\n")
    with pytest.raises(ConfigError, match="^tracking.password: there is no config key for a secret.*"
                                          "MLFLOW_TRACKING_PASSWORD") as e:
        load_config(p)
    assert "hunter2" not in str(e.value)
    # no credential: a user without a password, an endpoint without credentials, keys that only contain "token"
    cfg = load_config(TINY, ["tracking.uri=https://alice@mlflow.example.com", "model.tokenizer=gpt2",
                             "run.storage_path=s3://runs/x?endpoint_override=http://127.0.0.1:9000&region=eu-west-1",
                             "tracking.enabled=false"])
    assert flatten(cfg)["model.tokenizer"] == "gpt2"  # redaction masks secrets, not every key with "token" in it
    # a dump written with its credentials masked loads again
    assert load_config(TINY, ["tracking.uri=https://alice:***@mlflow.example.com"]).tracking.uri.endswith("example.com")


def test_secrets_are_redacted_in_dumps_behind_the_refusal():
    # the second line of defence: a value set in code after the checks is still masked in dumps and params
    cfg = load_config(TINY)
    cfg.tracking.uri = "https://user:s3cret@mlflow.example.com"
    cfg.run.storage_path = "s3://runs/x?endpoint_override=http://u:epsecret@127.0.0.1:9&secret_key=qsecret"
    dumps = to_yaml(cfg, redact=True) + str(flatten(cfg))
    assert not [w for w in ("s3cret", "epsecret", "qsecret") if w in dumps], dumps


def test_search_space_numbers_written_without_a_dot(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text("tune:\n  space:\n    optim.lr: {loguniform: [1e-5, 1e-3]}\n    controller.kp: {choice: [1e-1, 0.8]}\n")
    cfg = load_config(p)
    assert cfg.tune.space["optim.lr"] == {"loguniform": [1e-5, 1e-3]}
    assert cfg.tune.space["controller.kp"] == {"choice": [0.1, 0.8]}


def test_help_lists_every_key_with_its_default_and_a_description():
    from dataclasses import asdict

    from raytrain_scu.config.io import describe, flatten, help_text
    from raytrain_scu.config.schema import Config

    rows = {key: (default, note) for _, section in describe() for key, default, note in section}
    assert set(rows) == set(flatten(Config(), redact=False))  # every key, generated from the tree
    assert all(note for _, note in rows.values()), [k for k, (_, n) in rows.items() if not n]
    assert rows["train.max_steps"][0] == str(asdict(Config())["train"]["max_steps"])
    text = help_text()
    assert "  controller.kp = 0.8" in text and "proportional gain" in text and "\nmodel:\n" in text


def test_cli_help_prints_every_section(tmp_path):
    import subprocess
    import sys

    from conftest import ROOT

    r = subprocess.run([sys.executable, "-m", "raytrain_scu.train", "--help"], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("usage: python -m raytrain_scu.train")
    for section in ("model", "lora", "quant", "data", "optim", "train", "controller", "scaling", "run", "tracking",
                    "tune", "hardware"):
        assert f"\n{section}:\n" in r.stdout
    assert "data.block_size = 256" in r.stdout
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing here yet\n")
    r = subprocess.run([sys.executable, "-m", "raytrain_scu.train", str(empty)], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 2 and "is empty" in r.stderr and "Ray" not in r.stdout + r.stderr


@pytest.mark.parametrize("text", ["", "# only a comment\n", "\n\n"])
def test_empty_config_file_is_refused(tmp_path, text):
    p = tmp_path / "empty.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError, match="is empty"):
        load_config(p)


def test_controller_checks_are_one_copy_shared_by_config_and_controller():
    """Fixed mode with lambda_min=2 > lambda_max=1 once passed the config check and then raised on the worker."""
    from raytrain_scu.config.schema import ControllerConfig
    from raytrain_scu.core.controller import SCUController

    bad = ["controller.mode=fixed", "controller.lambda_min=2", "controller.lambda_max=1"]
    with pytest.raises(ConfigError, match=r"controller\.lambda_max: must be > lambda_min"):
        load_config(TINY, bad)
    with pytest.raises(ConfigError, match=r"controller\.lambda_max: must be > lambda_min"):
        SCUController(mode="fixed", lambda_min=2.0, lambda_max=1.0)
    # the public API's keyword defaults are the config's defaults, but for its mode: SCUController is the SCU
    import inspect

    d = ControllerConfig()
    params = {k: p for k, p in inspect.signature(SCUController).parameters.items() if k != "mode"}
    assert {k: getattr(d, k) for k in params} == {k: p.default for k, p in params.items()}
    assert SCUController().mode == "scu" and d.mode == "none"


def test_make_ui_opens_the_store_the_config_uses(tmp_path):
    """`make ui` asks `python -m raytrain_scu.tracking uri CONFIG` for the URI the config's runs write to."""
    import subprocess
    import sys

    from conftest import ROOT

    r = subprocess.run([sys.executable, "-m", "raytrain_scu.tracking", "uri", TINY, f"run.storage_path={tmp_path}"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == f"sqlite:///{tmp_path}/mlflow.db"
    r = subprocess.run([sys.executable, "-m", "raytrain_scu.tracking", "uri", TINY, "tracking.uri=http://mlflow:5000"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.stdout.strip() == "http://mlflow:5000"
    make = subprocess.run(["make", "-n", "ui", f"CONFIG={TINY}"], capture_output=True, text=True, cwd=ROOT,
                          env={k: v for k, v in __import__("os").environ.items() if not k.startswith("MAKE")})
    assert f"raytrain_scu.tracking uri {TINY}" in make.stdout


def test_the_config_names_exactly_the_tables_entries():
    """The config checks names without importing the tables (it sits below them): each list must be its table's keys,
    so a new data source, preset or control law is one table entry plus one word here, and this test says which."""
    import re
    from pathlib import Path

    from raytrain_scu.config.schema import LAW_KEYS
    from raytrain_scu.core.data.sources import SOURCES
    from raytrain_scu.core.laws import LAWS
    from raytrain_scu.hardware.presets import PRESETS

    text = (Path(__file__).parents[1] / "raytrain_scu" / "config" / "checks.py").read_text()

    def choices(key: str) -> set[str]:
        m = re.search(rf'_one_of\("{re.escape(key)}", [^,]+, \(([^)]*)\)', text)
        assert m, key
        return set(re.findall(r'"([^"]+)"', m.group(1)))

    assert choices("data.source") == set(SOURCES) | {"auto"}
    assert choices("hardware.preset") == set(PRESETS) | {"none", "auto"}
    assert choices("controller.law") == set(LAWS) == set(LAW_KEYS)


def test_a_bad_config_is_refused_without_importing_torch():
    """The CLIs check the config before anything heavy loads: a bad key is an error in a fraction of a second."""
    import subprocess
    import sys

    code = ("import sys; from raytrain_scu.cli.train import main; "
            "rc = main(['experiments/tiny-cpu.yaml', 'controller.target_s=2']); "
            "print(rc, 'torch' in sys.modules, 'ray' in sys.modules)")
    from conftest import ROOT

    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.stdout.split() == ["2", "False", "False"], r.stdout + r.stderr


# ---------------------------------------------------------------- the laws' own keys

def resolved(path=TINY, *overrides):
    from raytrain_scu.driver.resolve import resolve_config

    return resolve_config(path, list(overrides), gpus=[])[0]


def test_a_key_of_a_law_that_no_run_uses_is_refused_where_it_is_set(tmp_path):
    """controller.law defaults to logodds: a spec gain set in the overrides or the YAML file would change nothing, so
    the front door refuses it, naming the key and the two ways out; the same for a logodds key under law=spec."""
    with pytest.raises(ConfigError, match=r"^controller\.kp=0\.5: a key of the spec law, but controller\.law is "
                                          r"logodds, so it changes nothing: set controller\.law=spec to use it, or "
                                          r"tune controller\.logodds_kp instead$"):
        resolved(TINY, "controller.kp=0.5")
    tree = yaml.safe_load(open(TINY).read())
    tree["controller"]["deadband"] = 0.01
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(tree))
    with pytest.raises(ConfigError, match=r"^controller\.deadband=0\.01: a key of the spec law.*: set "
                                          r"controller\.law=spec to use it$"):  # no logodds key does its job
        resolved(p)
    tree["controller"]["law"] = "spec"
    p.write_text(yaml.safe_dump(tree))
    assert resolved(p).controller.deadband == 0.01
    assert resolved(TINY, "controller.law=spec", "controller.kp=0.5").controller.kp == 0.5
    with pytest.raises(ConfigError, match=r"^controller\.logodds_ki=0\.5: a key of the logodds law, but "
                                          r"controller\.law is spec.*or tune controller\.ki instead$"):
        resolved(TINY, "controller.law=spec", "controller.logodds_ki=0.5")
    # by law, not by mode: a fixed-λ config runs no law, and its spec gain is refused all the same
    with pytest.raises(ConfigError, match=r"^controller\.kp=0\.5: "):
        resolved(TINY, "controller.mode=fixed", "controller.kp=0.5")
    assert resolved(TINY, "controller.logodds_kp=3").controller.logodds_kp == 3.0
    # the law left to its default: a spec gain is refused at its default value too (a file written for the spec's
    # law would run the logodds law); with the law named, a gain at its default passes
    with pytest.raises(ConfigError, match=r"^controller\.kp=0\.8: a key of the spec law"):
        resolved(TINY, "controller.kp=0.8")
    assert resolved(TINY, "controller.law=logodds", "controller.kp=0.8").controller.law == "logodds"
    # the law set by tune.space: the way out is there
    with pytest.raises(ConfigError, match=r"^controller\.logodds_kp=3\.0: .*every run of this config uses the spec "
                                          r"law \(tune\.space sets the law\), so it changes nothing: run the logodds "
                                          r"law in tune\.space to use it"):
        resolved(TINY, "controller.logodds_kp=3", "tune.space={arm: {grid: [{controller.law: spec}]}}")
    # a full config sets every key, the other law's at its defaults: it passes (this CLI prints one)
    full = tmp_path / "full.yaml"
    full.write_text(to_yaml(load_config(TINY, ["controller.logodds_kp=3"])))
    assert resolved(full).controller.logodds_kp == 3.0
    # a sweep over both laws reads the spec's gain in some of its trials
    assert resolved(TINY, "controller.kp=0.5", "tune.space={controller.law: {grid: [spec, logodds]}}").controller.kp \
        == 0.5
    assert resolved(TINY, "controller.kp=0.5", "tune.space={arm: {grid: [{controller.law: spec}, "
                                               "{controller.mode: fixed}]}}").controller.kp == 0.5


def test_a_search_space_over_a_law_that_no_trial_runs_is_refused(tmp_path):
    """tune.space: an entry over a key of a law no trial runs, or an arm setting a key of a law other than the one it
    runs (its own controller.law, else the base's), is refused; each law's keys pass where some trial runs it."""
    from raytrain_scu.ray.tune import space as sweep_space

    with pytest.raises(ConfigError, match=r"^tune\.space\.controller\.kp: sweeps a key of the spec law, but "
                                          r"controller\.law is logodds, so it changes nothing: set "
                                          r"controller\.law=spec to sweep it, or sweep controller\.logodds_kp "
                                          r"instead$"):
        resolved(TINY, "tune.space={controller.kp: {loguniform: [0.1, 2.0]}}")
    with pytest.raises(ConfigError, match=r"^tune\.space\.controller\.logodds_max_step: sweeps a key of the logodds "
                                          r"law, but controller\.law is spec"):
        resolved(TINY, "controller.law=spec", "tune.space={controller.logodds_max_step: {choice: [0.1, 0.5]}}")
    assert resolved(TINY, "tune.space={controller.logodds_kp: {loguniform: [0.5, 8.0]}}").tune.space
    # the trials run both laws: either law's keys may be swept
    both = resolved(TINY, f"run.storage_path={tmp_path}", "tune.space={controller.law: {choice: [spec, logodds]}, "
                          "controller.kp: {loguniform: [0.1, 2.0]}, controller.logodds_kp: {loguniform: [0.5, 8.0]}}")
    for law in ("spec", "logodds"):  # each trial carries both gains: the one of the law it does not run is idle
        params = {"controller.law": law, "controller.kp": 0.5, "controller.logodds_kp": 3.0}
        assert sweep_space.trial_config(both, params, "t").controller.law == law
    # an arm: its own law, else the base's
    mixed = ("tune.space={arm: {grid: [{controller.law: spec, controller.kp: 0.5}, {controller.logodds_kp: 3.0}, "
             "{controller.law: logodds, controller.logodds_ki: 0.1}]}}")
    cfg = resolved(TINY, mixed)
    with pytest.raises(ConfigError, match=r"^tune\.space\.arm\[1\]: sets controller\.kp, a key of the spec law, but "
                                          r"this arm runs the logodds law, so it changes nothing: set "
                                          r"controller\.law=spec in the arm to use it, or set controller\.logodds_kp "
                                          r"instead$"):
        resolved(TINY, "tune.space={arm: {grid: [{controller.law: spec}, {controller.kp: 0.5}]}}")
    with pytest.raises(ConfigError, match=r"^tune\.space\.arm\[0\]: sets controller\.logodds_kp"):
        resolved(TINY, "tune.space={arm: {grid: [{controller.law: spec, controller.logodds_kp: 3.0}]}}")
    # a space over a spec key with arms that run only logodds, and a space set on a resolved config (as a study
    # sets its stage's), are refused by the sweep's own check too
    with pytest.raises(ConfigError, match=r"^tune\.space\.controller\.ki: sweeps a key of the spec law, but every run "
                                          r"of this config uses the logodds law"):
        resolved(TINY, "controller.law=spec", "tune.space={arm: {grid: [{controller.law: logodds}]}, "
                                              "controller.ki: {loguniform: [0.01, 0.5]}}")
    late = resolved(TINY, f"run.storage_path={tmp_path}", "tune.search=random")
    late.tune.space = {"controller.kp": {"loguniform": [0.1, 2.0]}}
    with pytest.raises(sweep_space.SweepError, match=r"^tune\.space\.controller\.kp: sweeps a key of the spec law"):
        sweep_space.resolve_space(late)
    # each trial's config is the base with its arm's law set: it builds (validate does not re-judge the base's arms)
    cfg.run.storage_path = str(tmp_path)
    for arm in cfg.tune.space["arm"]["grid"]:
        trial = sweep_space.trial_config(cfg, {"arm": arm}, "t")
        assert trial.controller.law == arm.get("controller.law", Config().controller.law)
    # a trial whose values sweep another law's key (a restored Tune experiment keeps the space it started with)
    with pytest.raises(ConfigError, match=r"^trial value controller\.kp=0\.5: a key of the spec law, but this trial "
                                          r"runs the logodds law, so it changes nothing: the Tune experiment was "
                                          r"started for the spec law"):
        sweep_space.trial_config(cfg, {"controller.kp": 0.5}, "t")
