"""Bad inputs: each is refused before any Ray worker starts, with a message that names the problem, exit code 2.

Most cases call ``train.main`` in this process with Ray's start replaced by a failure (fast); a few call it with Ray
as this process has it (HF_HUB_OFFLINE is read when the model is checked, so the test sets it for the call); the case
that depends on whether Ray runs in the process (the local CPU count) and one representative run the real CLI in a
subprocess.
The table of cases and messages is in docs/reliability.md. A resumed run whose checkpoint has a different structure is
tested in test_reliability.py (it needs a real earlier run).
"""
import json
import subprocess
import sys

import pytest
from conftest import ROOT, TINY, cli


def text_file(tmp_path, name: str, data: bytes) -> str:
    p = tmp_path / name
    p.write_bytes(data)
    return str(p)


def jsonl_without_text(tmp_path) -> str:
    return text_file(tmp_path, "d.jsonl", json.dumps({"body": "no text field here"}).encode() + b"\n")


def chats(tmp_path) -> str:
    line = {"messages": [{"role": "user", "content": "Who?"}, {"role": "assistant", "content": "Hamlet."}]}
    return text_file(tmp_path, "d.jsonl", json.dumps(line).encode() + b"\n")


def yaml_with(tmp_path, body: str, after: str = "") -> str:
    """TINY's YAML with ``body`` added at its end, or after the line ``after`` (inside its section)."""
    p = tmp_path / "bad.yaml"
    text = open(TINY).read()
    p.write_text(text.replace(after, after + body, 1) if after else text + body)
    return str(p)


# name -> (argv after the program name, given tmp_path; substrings the error must contain)
CASES = {
    "unknown key": (lambda t: [TINY, "train.max_stepz=5"], ["unknown config key 'train.max_stepz'"]),
    "unknown key in the YAML file": (lambda t: [yaml_with(t, "extra_section:\n  a: 1\n")],
                                     ["unknown config key 'extra_section'"]),
    "wrong type": (lambda t: [TINY, "train.max_steps=ten"], ["train.max_steps", "expected an int", "'ten'"]),
    "wrong type in the YAML file": (lambda t: [yaml_with(t, "hardware:\n  preset: [a100]\n")],
                                    ["hardware.preset", "expected a string"]),
    "override without '='": (lambda t: [TINY, "train.max_steps"], ["train.max_steps", "expected key=value"]),
    "config file missing": (lambda t: [str(t / "nope.yaml")], ["config file not found", "nope.yaml"]),
    "config file not YAML": (lambda t: [text_file(t, "x.yaml", b"seed: [0\n")], ["not valid YAML"]),
    "negative lr": (lambda t: [TINY, "optim.lr=-0.001"], ["optim.lr", "must be > 0", "-0.001"]),
    "target_s above 1": (lambda t: [TINY, "controller.target_s=1.5"], ["controller.target_s", "(0, 1)", "1.5"]),
    "target_s = 0": (lambda t: [TINY, "controller.target_s=0"], ["controller.target_s", "(0, 1)"]),
    "kp < 0": (lambda t: [TINY, "controller.kp=-0.5"], ["controller.kp", "must be >= 0", "-0.5"]),
    "lambda bounds inverted": (lambda t: [TINY, "controller.lambda_min=5", "controller.lambda_max=1"],
                               ["controller.lambda_max", "must be > lambda_min", "5.0"]),
    "batch size 0": (lambda t: [TINY, "data.batch_size=0"], ["data.batch_size", "must be >= 1", "got 0"]),
    "val_fraction 1": (lambda t: [TINY, "data.val_fraction=1.0"], ["data.val_fraction", "(0, 1)"]),
    "checkpoint_every not a multiple of report_every": (lambda t: [TINY, "train.checkpoint_every=7"],
                                                        ["train.checkpoint_every", "multiple of train.report_every"]),
    "malformed search space (low > high)": (lambda t: [TINY, "tune.space={controller.kp: {loguniform: [2.0, 0.1]}}"],
                                            ["tune.space.controller.kp", "low < high"]),
    "search space on an unknown key": (lambda t: [TINY, "tune.space={controller.kq: {choice: [1, 2]}}"],
                                       ["tune.space.controller.kq", "is not a config key"]),
    "search space of an unknown kind": (lambda t: [TINY, "tune.space={optim.lr: {normal: [0, 1]}}"],
                                        ["tune.space.optim.lr", "unknown kind 'normal'"]),
    "a gain of the law that does not run": (lambda t: [TINY, "controller.kp=0.5"],
                                            ["controller.kp=0.5: a key of the spec law, but controller.law is logodds",
                                             "set controller.law=spec to use it, or tune controller.logodds_kp"]),
    "a key of the law that does not run, in the YAML file": (
        lambda t: [yaml_with(t, "  deadband: 0.01\n", after="  target_s: 0.01\n")],
        ["controller.deadband=0.01: a key of the spec law", "set controller.law=spec to use it"]),
    "search space over the law that does not run": (
        lambda t: [TINY, "tune.space={controller.ki: {loguniform: [0.01, 0.5]}}"],
        ["tune.space.controller.ki: sweeps a key of the spec law", "or sweep controller.logodds_ki instead"]),
    # ---- found by preflight (I/O on the driver, still before Ray)
    "block_size beyond the model's positions": (lambda t: [TINY, "data.block_size=4096"],
                                                ["data.block_size=4096", "2048 positions"]),
    "data path missing": (lambda t: [TINY, "data.source=text", f"data.path={t}/missing.txt"],
                          ["data.path: ", "missing.txt does not exist"]),
    "data path not set": (lambda t: [TINY, "data.source=text"], ["data.path", "must be set for data.source=text"]),
    "data empty": (lambda t: [TINY, "data.source=text", f"data.path={text_file(t, 'empty.txt', b'  ')}"],
                   ["data.path: no text in", "empty"]),
    "data undecodable": (lambda t: [TINY, "data.source=text",
                                    f"data.path={text_file(t, 'bin.txt', b'ok then ' + bytes([0xff, 0xfe, 0x00]))}"],
                         ["bin.txt is not UTF-8", "0xff", "byte offset 8"]),
    "jsonl without the text field": (lambda t: [TINY, "data.source=jsonl", f"data.path={jsonl_without_text(t)}"],
                                     ["d.jsonl:1", "no field 'text'", "data.text_field"]),
    "training split smaller than one global batch": (lambda t: [TINY, "data.batch_size=100000"],
                                                     ["fewer than one global batch", "data.batch_size=799 fits"]),
    "a few documents of a text file": (  # its paragraphs, first two read: too few tokens for a block
        lambda t: [TINY, "data.source=text", "data.max_documents=2",
                   "data.path=" + str(text_file(t, "notes.txt", b"A short paragraph of notes." + 300 * b"\n\nMore."))],
        ["too few for one block",
         "(data.max_documents=0 reads the whole source, of which this config reads 2 documents"]),
    "a few blocks of a text file": (  # the first four paragraphs: a block or two, fewer than one global batch
        lambda t: [TINY, "data.source=text", "data.max_documents=4", "data.val_fraction=0.25", "data.path="
                   + str(text_file(t, "notes.txt", 40 * (100 * b"word " + b"\n\n")))],
        ["fewer than one global batch", "): data.max_documents=0 reads the whole source, of which this config reads 4 "
                                        "documents (a text file's documents are its blank-line-separated sections)"]),
    "conversations read as text": (lambda t: [TINY, "data.source=jsonl", "data.text_field=messages",
                                              f"data.path={chats(t)}"],
                                   ["d.jsonl:1: field 'messages' (data.text_field) is list, not a string",
                                    "a conversation", "data.source=chat"]),
    "missing GGUF file": (lambda t: [TINY, f"model.name={t}", "model.gguf_file=missing.gguf"],
                          ["model.gguf_file", "GGUF file not found", "missing.gguf"]),
    "model directory without config.json": (lambda t: [TINY, f"model.name={t}"], ["has no config.json"]),
    "LoRA target module the model lacks": (lambda t: [TINY, "lora.target_modules=q_proj,qkv_proj"],
                                           ["lora.target_modules", "qkv_proj", "not found in tiny"]),
    "use_gpu with no GPU": (lambda t: [TINY, "scaling.use_gpu=true"], ["scaling.use_gpu=true", "no CUDA GPU"]),
    "fp16 on CPU workers": (lambda t: [TINY, "model.precision=fp16"], ["model.precision=fp16", "CUDA", "fp32 or bf16"]),
    "4-bit with fp16 on CPU": (lambda t: [TINY, "quant.load_in_4bit=true", "model.precision=fp16"],
                               ["model.precision=fp16", "also with quant.load_in_4bit"]),
    "offloading a tied embedding": (lambda t: [TINY, "quant.offload_embedding=true"],
                                    ["quant.offload_embedding: this model ties its input embedding to its LM head",
                                     "quant.embedding_int8=true"]),
    "LoRA on a table made int8": (lambda t: [TINY, "quant.embedding_int8=true",
                                             "lora.target_modules=q_proj,embed_tokens"],
                                  ["lora.target_modules: ['embed_tokens'] would put LoRA on the embedding"]),
    "offloaded activations without checkpointing or a budget": (
        lambda t: [TINY, "model.offload_activations=true"],
        ["model.offload_activations: needs model.gradient_checkpointing=true or a budget, "
         "model.offload_activations_gib > 0"]),
    "an activation budget with the offload off": (
        lambda t: [TINY, "model.offload_activations_gib=2"],
        ["model.offload_activations_gib: is a budget for model.offload_activations, which is off"]),
    "torch dequantisation of fp4 codes": (lambda t: [TINY, "quant.load_in_4bit=true", "quant.quant_type=fp4",
                                                     "quant.dequant_4bit=torch"],
                                          ["quant.dequant_4bit: torch reads nf4 codes, not quant.quant_type=fp4",
                                           "quant.dequant_4bit=bitsandbytes"]),
    "unwritable storage path": (lambda t: [TINY, f"run.storage_path={text_file(t, 'a-file', b'x')}/runs"],
                                ["run.storage_path=", "not writable"]),
}


@pytest.fixture
def no_ray(monkeypatch):
    """train.main in this process, where starting Ray fails the test."""
    import raytrain_scu.train as train
    from raytrain_scu.ray import launch

    def refuse(*args, **kwargs):  # whatever init_ray is called with: the message below, not a TypeError
        raise AssertionError("Ray was about to start: the bad input was not caught early")

    monkeypatch.setattr(launch, "init_ray", refuse)
    # preflight checks this machine's CPUs and GPUs only when no Ray is up here (a Ray up is a cluster it defers
    # to): an earlier test file in this process may have left one, which these checks must not see
    monkeypatch.setattr(launch.ray, "is_initialized", lambda: False)
    return train.main


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_refused_early_with_a_clear_message(name, tmp_path, no_ray, capsys):
    argv_of, expected = CASES[name]
    code = no_ray(argv_of(tmp_path))
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and all(s in err for s in expected), err
    print(f"BAD_INPUT {json.dumps({'case': name, 'message': err.strip()})}")


@pytest.mark.parametrize("args, expected", [
    (["data.streaming=yes"], ["data.streaming", "'yes'"]),
    (["data.shard_bytes=100"], ["data.shard_bytes: must be in [4096, 268435456]", "got 100"]),
    (["data.shard_bytes=1073741824"], ["data.shard_bytes: must be in [4096, 268435456]", "got 1073741824"]),
    (["data.streaming=on", "data.max_documents=5"], ["data.max_documents: must be 0 with data.streaming=on", "got 5"]),
])
def test_a_bad_streaming_setting_is_refused_early(args, expected, tmp_path, no_ray, capsys):
    """The streamed path's settings (docs/reliability.md, Bad inputs, rows 35g-35j)."""
    code = no_ray([TINY, f"run.storage_path={tmp_path}", *args])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and all(s in err for s in expected), err


def test_more_workers_than_gpus(tmp_path, no_ray, capsys, monkeypatch):
    from raytrain_scu.driver import preflight

    monkeypatch.setattr(preflight, "visible_gpus", lambda: 1)  # this machine has none; pretend one
    code = no_ray([TINY, "scaling.use_gpu=true", "scaling.num_workers=2", f"run.storage_path={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 2 and "scaling.num_workers=2 x gpus_per_worker=1 needs 2 GPUs but this machine has 1" in err
    print(f"BAD_INPUT {json.dumps({'case': 'more workers than GPUs', 'message': err.strip()})}")


def test_a_launch_checks_the_storage_path_and_the_data_once(tmp_path, no_ray, capsys, monkeypatch):
    """The CLI checks run.storage_path and the data source before it imports the driver; the run (which checks them
    before taking its lock when called directly) and preflight (which checks them for the sweep) skip them."""
    from raytrain_scu.driver import early

    calls = []
    storage, source = early.check_storage, early.check_source
    monkeypatch.setattr(early, "check_storage", lambda cfg: calls.append("storage") or storage(cfg))
    monkeypatch.setattr(early, "check_source", lambda *a: calls.append("data") or source(*a))
    # refused by preflight after its machine checks (the tiny model ties its embeddings): every check before ran
    code = no_ray([TINY, f"run.storage_path={tmp_path}", "quant.offload_embedding=true"])
    assert code == 2 and "quant.offload_embedding" in capsys.readouterr().err
    assert calls == ["storage", "data"]


def test_a_global_batch_the_data_cannot_fill_names_the_overrides_that_fit(tmp_path):
    from raytrain_scu.config.load import load_config
    from raytrain_scu.driver.preflight import fitting_overrides

    cfg = load_config(TINY, ["data.batch_size=8", "data.grad_accum=2", "scaling.num_workers=1", "data.block_size=256"])
    # 12 blocks against a global batch of 16; 16 blocks of 198 + 1 tokens fit the 3,184 tokens
    assert fitting_overrides(12, cfg, tokens=12 * 257 + 100) == ["data.batch_size=6", "data.grad_accum=1",
                                                                 "data.block_size=198"]
    assert fitting_overrides(12, cfg) == ["data.batch_size=6", "data.grad_accum=1"]  # rows: the block stays
    two = load_config(TINY, ["data.batch_size=4", "data.grad_accum=1", "scaling.num_workers=2"])
    assert fitting_overrides(5, two) == ["data.batch_size=2", "scaling.num_workers=1"]
    assert fitting_overrides(1, two, tokens=30) == []  # nothing fits: the message says to add data


# a missing or empty data file and an unwritable storage path, as a person types them: refused before the CLI imports
# torch, transformers or Ray (what made these take tens of seconds on 2 cores), which -X importtime shows
@pytest.mark.parametrize("name, args, expected", [
    ("data path missing (CLI)", ["data.source=text", "data.path={tmp}/missing.txt"],
     "data.path: {tmp}/missing.txt does not exist"),
    ("data empty (CLI)", ["data.source=text", "data.path={tmp}/empty.txt"], "data.path: no text in text data at"),
    ("jsonl empty (CLI)", ["data.source=jsonl", "data.path={tmp}/empty.jsonl"],
     "data.path: no records in jsonl data at"),
    ("storage path unwritable (CLI)", ["run.storage_path={tmp}/a-file/runs"], "run.storage_path={tmp}/a-file/runs: "
                                                                              "not writable"),
])
@pytest.mark.slow
def test_bad_inputs_are_refused_before_the_heavy_imports(name, args, expected, tmp_path):
    for file, data in (("empty.txt", b""), ("empty.jsonl", b"\n"), ("a-file", b"x")):
        (tmp_path / file).write_bytes(data)
    argv = [f"run.storage_path={tmp_path}", *[a.format(tmp=tmp_path) for a in args]]
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "raytrain_scu.train", TINY, *argv],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert r.returncode == 2 and len(errors) == 1 and expected.format(tmp=tmp_path) in errors[0], r.stderr[-3000:]
    imported = {line.rsplit("|", 1)[1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert "raytrain_scu.driver.resolve" in imported  # -X importtime did report the imports
    assert not imported & {"torch", "transformers", "ray", "mlflow", "peft"}, sorted(imported & {"torch", "ray"})
    print(f"BAD_INPUT {json.dumps({'case': name, 'message': errors[0]})}")


# train.main in this process, nothing replaced: exit code, message, and no Ray started by the call
@pytest.mark.parametrize("name, args, env, expected", [
    ("unknown model id offline", ["model.name=no-such-org/no-such-model"], {"HF_HUB_OFFLINE": "1"},
     ["model.name=no-such-org/no-such-model", "HF_HUB_OFFLINE=1"]),
    ("undecodable data (Ray untouched)", ["data.source=text", "data.path={tmp}/bin.txt"], {}, ["bin.txt is not UTF-8"]),
])
def test_train_main_refuses_bad_input_without_starting_ray(name, args, env, expected, tmp_path, monkeypatch, capfd):
    import ray

    import raytrain_scu.train as train

    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    # an earlier test in this process may have joined the tests' Ray (ray_local): the call must not start or leave one
    ray_before = ray.is_initialized()
    code = train.main([TINY, f"run.storage_path={tmp_path}", *[a.format(tmp=tmp_path) for a in args]])
    out, err = capfd.readouterr()
    assert code == 2 and all(s in err for s in expected), (out + err)[-3000:]
    assert ray.is_initialized() is ray_before
    assert "Started a local Ray instance" not in out + err and "RayTrainWorker" not in out + err
    message = next(line for line in err.splitlines() if line.startswith("error: "))
    print(f"BAD_INPUT {json.dumps({'case': name, 'message': message})}")


# the real CLI: exit code, message, and no Ray instance started. More workers than CPUs is checked only where no Ray
# runs in the process (a Ray up is a cluster it defers to), which a fresh process guarantees; an unknown key is the
# program as a person runs it (refused before torch loads: a tenth of a second)
@pytest.mark.parametrize("name, args, expected", [
    ("more workers than CPUs", ["scaling.num_workers=4096"], ["scaling.num_workers=4096", "needs 4096 CPUs"]),
    ("unknown key (CLI)", ["train.max_stepz=5"], ["unknown config key 'train.max_stepz'"]),
])
@pytest.mark.slow
def test_cli_bad_input_exits_non_zero_without_starting_ray(name, args, expected, tmp_path):
    r = cli(f"run.storage_path={tmp_path}", *args, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 2 and all(s in r.stderr for s in expected), out[-3000:]
    assert "Started a local Ray instance" not in out and "RayTrainWorker" not in out
    message = next(line for line in r.stderr.splitlines() if line.startswith("error: "))
    print(f"BAD_INPUT {json.dumps({'case': name, 'message': message})}")
