# The two commands of the README: `make train` and `make test`. Each creates .venv on first use and
# re-installs only when pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
export TF_CPP_MIN_LOG_LEVEL ?= 2

# Cloud TPU (infra/ and tpu_llm/cloud/driver.py, run as `python -m tpu_llm.cloud`; see infra/README.md).
# Settings, all optional, given on the command line or in the environment (make passes both to the driver):
#   DRY_RUN=1        print every terraform/gcloud command instead of running it
#   CONFIG=FILE      config to train (default configs/tiny.yaml, also for the local run)
#   ARGS='--k=v ..'  extra `tpu-llm train` overrides (local and TPU)
#   RUN=NAME         TPU run directory gs://BUCKET/runs/NAME (default: the config's name); RUN_DIR=gs://...
#   DATA=GLOB        TPU training data (a pod slice defaults to gs://BUCKET/shards/*.tfrecord)
#   TOKENIZER=KIND   data.tokenizer of the shards (data-upload default: byte); TOKENIZER_MODEL=FILE
#   INPUT=GLOB SHARDS=N OVERWRITE=1   data-upload: text to tokenize, shard count (default 32, balanced by tokens), replace old shards
#   TRAIN_ON=auto|tpu|local   where `make train` runs (auto: the TPU if `make tpu-up` made one)
#   WORKER=N LOGS=train|gcs|setup LOG_LINES=N PORT=6006 DESTROY_BUCKET=1 YES=1 TPU_SSH=iap|internal TPU_WAIT_MINUTES=30
#   KEEP_QUEUED=1    tpu-up: request a queued resource for KEEP_QUEUED_HOURS=24 and leave it waiting past
#                    TPU_WAIT_MINUTES or Ctrl-C (default: it lasts the wait, and is deleted then)
#   DOWN_AFTER=1     train: worker 0 deletes its TPU itself when the run ends or fails (the laptop may go away)
#   TTL_HOURS=N      train: worker 0 stops the run after N hours (SIGTERM: a checkpoint) and deletes the TPU
#                    (given to a make train that attaches to a live run: N hours from then, for that run)
#   TF_STATE_BUCKET=NAME   tpu-up/tpu-down: the Terraform state's bucket (default PROJECT_ID-NAME_PREFIX-tf)
#   REPLACE=1        tpu-up: apply a plan that replaces the running TPU, a queued resource's too (else refused;
#                    a new image, type, zone, spot or use_queued_resource needs it)
#   FORCE=1          tpu-down, tpu-up REPLACE=1: delete the TPU without asking worker 0 whether a run trains there
CONFIG ?= configs/tiny.yaml
TPU := $(PYTHON) -m tpu_llm.cloud

# Offline checks of infra/ (terraform fmt, checkov, shellcheck) use a separate tools venv: checkov's
# pins clash with the training environment.
TOOLS := $(VENV)/tools
TOOLS_STAMP := $(TOOLS)/.installed

.PHONY: train test test-fast faults mutants bench clean tpu-up tpu-down tpu-status tpu-ssh tpu-logs tpu-stop tensorboard data-upload infra-check docs-check

# One TensorFlow wheel per environment, chosen by extra (pyproject.toml): here the CPU one, with
# tensorflow-text for SentencePiece and Hugging Face interop (hf): what training needs, all `make train`
# installs. `make test` adds the test tools (dev) and the reference implementation the import/export
# tests compare with (reference: torch CPU and transformers, ~1 GB that training never uses) and
# lm-evaluation-harness (eval: `tpu-llm eval` and its equivalence tests against lm-eval's own hf backend).
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[cpu,sentencepiece,hf]'
	@touch $(STAMP)

$(DEV_STAMP): $(STAMP) pyproject.toml
	$(BIN)/python -m pip install --quiet -e '.[cpu,sentencepiece,hf,dev,reference,eval]'
	@touch $(DEV_STAMP)

$(TOOLS_STAMP):
	@test -x $(TOOLS)/bin/python || $(PYTHON) -m venv $(TOOLS)
	$(TOOLS)/bin/python -m pip install --quiet --upgrade pip
	$(TOOLS)/bin/python -m pip install --quiet 'checkov>=3.3,<4'
	@touch $(TOOLS_STAMP)

train: export CONFIG := $(CONFIG)
train: $(STAMP)  ## on the Cloud TPU when `make tpu-up` made one, else configs/tiny.yaml on this machine
	@$(BIN)/python -m tpu_llm.cloud train --local-command '$(BIN)/tpu-llm train --config $(CONFIG)'

test: $(DEV_STAMP) $(TOOLS_STAMP)  ## the CPU test suite (with the offline infra/ checks), two pytest-xdist workers
	$(BIN)/python -m pytest -q -n 2 --dist worksteal

test-fast: $(DEV_STAMP)  ## the suite without the tests marked slow (subprocesses, local clusters, the notebook, infra/ checks)
	$(BIN)/python -m pytest -q -n 2 --dist worksteal -m "not slow"

faults: $(DEV_STAMP)  ## fault injection into tiny real runs (signals, kills, torn files, NaN, full disk); docs/faults.md
	$(BIN)/python scripts/faults.py

mutants: $(DEV_STAMP)  ## curated mutations of the core, each against the tests that must catch it (docs/development.md); not part of `make test`
	$(BIN)/python scripts/mutants.py

bench: $(DEV_STAMP)  ## benchmarks (docs/benchmarks.md): shakespeare_char, strategies, execution modes, pipeline, comm, families, memory, data, placement
	$(BIN)/tpu-llm bench
	$(BIN)/tpu-llm bench strategies
	$(BIN)/tpu-llm bench modes
	$(BIN)/tpu-llm bench pipeline
	$(BIN)/tpu-llm bench comm
	$(BIN)/tpu-llm bench families
	$(BIN)/tpu-llm bench memory
	$(BIN)/tpu-llm bench data
	$(BIN)/tpu-llm bench placement

clean:  ## remove the virtual environments (runs/ is kept)
	rm -rf $(VENV)

tpu-up:  ## create (or recreate a preempted) Cloud TPU from infra/terraform.tfvars; waits until set up
	@$(TPU) up

tpu-down:  ## delete the TPU; keeps the bucket (DESTROY_BUCKET=1 deletes everything)
	@$(TPU) down

tpu-status:  ## state and health of the TPU (or queued resource) and its workers; the run's log tail from Cloud Storage
	@$(TPU) status

tpu-ssh:  ## ssh to a TPU worker (WORKER=0)
	@$(TPU) ssh

tpu-logs:  ## follow the training log on worker 0, or its copy on Cloud Storage once the TPU is gone (LOGS=setup: set-up logs)
	@$(TPU) logs

tpu-stop:  ## stop the training run on the TPU (SIGTERM: it saves a checkpoint first); the TPU stays until `make tpu-down`
	@$(TPU) stop

tensorboard: $(STAMP)  ## TensorBoard on the bucket's run directories, at http://localhost:6006
	@$(BIN)/python -m tpu_llm.cloud tensorboard

data-upload: $(STAMP)  ## tokenize INPUT into TFRecord shards and upload them to the bucket
	@$(BIN)/python -m tpu_llm.cloud data-upload

infra-check: $(DEV_STAMP) $(TOOLS_STAMP)  ## offline checks of infra/: terraform fmt, HCL structure, checkov, shellcheck
	$(BIN)/python -m pytest -q tests/test_infra.py

docs-check: $(DEV_STAMP)  ## run the command blocks of README.md and docs/*.md in a scratch copy, compare outputs (scripts/docs_check.py)
	$(BIN)/python scripts/docs_check.py
