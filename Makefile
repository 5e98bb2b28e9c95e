# vitserve: `make serve` runs the server with the bundled model; `make test` runs the test suite.
# Both set up their own virtual environment; serving installs no torch.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# setuptools' editable install warns, in ten lines, that folders named like the package may shadow it: our layers
# are such folders on purpose (vitserve/__init__.py). UserWarnings are silenced for the installs alone.
PIP := PYTHONWARNINGS=ignore::UserWarning $(BIN)/python -m pip
# `make serve` honours the server's own environment variables (VITSERVE_HOST, VITSERVE_PORT, VITSERVE_MODEL_PATH)
# as well as `make serve PORT=8080`.
HOST ?= $(or $(VITSERVE_HOST),127.0.0.1)
PORT ?= $(or $(VITSERVE_PORT),8000)
MODEL_DIR := models/vit-fmnist
DEFAULT_MODEL := $(MODEL_DIR)/model.onnx
SERVE_MODEL ?= $(or $(VITSERVE_MODEL_PATH),$(DEFAULT_MODEL))
TRAIN_RUN := training/vit-fmnist
# The hybrid candidate for the default model (docs/results.md, "Toward 94%"): its training state is committed, so a
# run resumes where the last one stopped
HYBRID_RUN := training/vit-fmnist-hybrid
TEACHER_RUN := training/fmnist-teacher
PYTEST_ARGS ?=
DOCKER_IMAGES ?= cpu gpu train stack

.PHONY: serve test model model-hybrid model-teacher model-distilled model-budgets export-default bench screenshots docker-test setup-serve setup-dev clean grpc-stubs system-deps

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# The serving world alone: onnxruntime, numpy, Pillow, FastAPI, uvicorn, prometheus-client.
$(VENV)/.serve-installed: pyproject.toml setup.py | $(BIN)/python
	$(PIP) install -q -e . -c constraints.txt
	touch $@

# Everything: training and export (torch pinned by constraints.txt) and the test tools.
$(VENV)/.dev-installed: pyproject.toml setup.py constraints.txt | $(BIN)/python
	$(PIP) install -q -e ".[train,export,dev]" -c constraints.txt
	# timm is only the reference implementation in the import tests. Its torchvision dependency has no
	# CPU build here and breaks transformers' imports when present, so install timm alone.
	$(PIP) install -q --no-deps "timm==1.0.31"
	touch $@ $(VENV)/.serve-installed

setup-serve: $(VENV)/.serve-installed
setup-dev: $(VENV)/.dev-installed

serve: $(VENV)/.serve-installed
	$(BIN)/vitserve serve --model $(SERVE_MODEL) --host $(HOST) --port $(PORT)

test: lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# Every test but those marked slow (pyproject.toml's `slow` marker: servers started, models trained or exported):
# about 2.5 minutes on two cores against `make test`'s 13, for a developer's inner loop
.PHONY: test-quick
test-quick: lint
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

# The linter and the type checker over model/, export/, service/, vitserve/ and the tools beside them, bench/ and
# evaluation/ (settings: pyproject.toml)
.PHONY: lint
lint: $(VENV)/.dev-installed
	$(BIN)/ruff check model export service vitserve bench evaluation
	$(BIN)/mypy

# What the whole suite uses from Debian beside Python (as root; tests that need one skip, saying so, without it):
# real Fashion-MNIST images, promtool and Prometheus, Chromium for the web page, openssl for the TLS tests.
SYSTEM_PACKAGES := dataset-fashion-mnist prometheus chromium openssl
system-deps:
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(SYSTEM_PACKAGES) >/dev/null

# Trains the default model on Fashion-MNIST (resumes if interrupted), then exports and verifies it.
model: $(VENV)/.dev-installed
	$(BIN)/vitserve train --model fmnist --epochs 60 --seed 0 --name vit-fmnist --version 1 \
		--out $(TRAIN_RUN) --resume
	rm -rf $(MODEL_DIR)/checkpoint && mkdir -p $(MODEL_DIR)
	cp -r $(TRAIN_RUN)/checkpoint $(MODEL_DIR)/checkpoint
	cp $(TRAIN_RUN)/log.csv $(TRAIN_RUN)/curves.png $(MODEL_DIR)/
	$(BIN)/python -m vitserve.model.report $(TRAIN_RUN) --out $(MODEL_DIR)/REPORT.md
	$(MAKE) export-default

# Trains (or continues) the hybrid candidate: `make model-hybrid TIME_LIMIT=40` stops after 40 minutes, resumable.
model-hybrid: $(VENV)/.dev-installed
	$(BIN)/vitserve train --model R+fmnist --backbone-layers 2 --backbone-width 32 --epochs 60 --seed 0 \
		--name vit-fmnist --version 2 --out $(HYBRID_RUN) --resume --no-progress \
		$(if $(TIME_LIMIT),--time-limit $(TIME_LIMIT))

# A convolutional teacher for distilling the default model (docs/results.md, "Toward 94%"): a ResNet of
# two stages on Fashion-MNIST upsampled to 56x56, so its convolutions see the 28x28 image at stride 2, not 4.
# `make model-teacher TIME_LIMIT=40` trains 40 minutes at a time, resumable.
model-teacher: $(VENV)/.dev-installed
	$(BIN)/vitserve train --model R+fmnist --backbone-layers 2,2 --backbone-width 32 --patch-size 8 --image-size 56 \
		--epochs 40 --seed 0 --name fmnist-teacher --version 1 --out $(TEACHER_RUN) --resume --no-progress \
		$(if $(TIME_LIMIT),--time-limit $(TIME_LIMIT))

# The default model fine-tuned with the three trained models as its teachers (docs/results.md: the plain ViT, the hybrid and
# the convolutional teacher at its epoch 38; the mean of their probabilities scores 94.24% on the test images), 6 epochs
# of about 10 minutes on two cores (the teachers' forward passes are most of a step): `make model-distilled
# TIME_LIMIT=40` trains 40 minutes at a time, resumable. It replaces the default only at 94.0% or more.
DISTILLED_RUN := training/vit-fmnist-distilled3
model-distilled: $(VENV)/.dev-installed
	$(BIN)/vitserve train --init-from $(MODEL_DIR)/checkpoint --distill-from $(MODEL_DIR)/checkpoint \
		--distill-from $(HYBRID_RUN)/checkpoint --distill-from $(TEACHER_RUN)/checkpoint --distill-weight 0.7 \
		--epochs 6 --lr 1.5e-4 --min-lr 1e-6 --warmup-epochs 0.25 --seed 1 --name vit-fmnist --version 2 \
		--out $(DISTILLED_RUN) --resume --no-progress $(if $(TIME_LIMIT),--time-limit $(TIME_LIMIT))

# The default model fine-tuned for token budgets (FlexiViT's recipe for our fixed patch): each step at an input grid
# drawn from the list (28 px, 49 tokens, half the time; 20 and 24 px, 25 and 36 tokens, a quarter each), resized as
# the server's Pillow BILINEAR resize does, the convolutional teacher seeing the full 28 px image; held-out accuracy
# logged at each size. The committed run drew from 12,16,20,24,28 uniformly for its first 3.6 epochs (log.csv keeps
# scoring 12 and 16 px). 8 epochs of about 7 minutes on one thread: `make model-budgets TIME_LIMIT=40` trains 40
# minutes at a time, resumable.
BUDGETS_RUN := training/vit-fmnist-budgets
model-budgets: $(VENV)/.dev-installed
	$(BIN)/vitserve train --init-from $(TRAIN_RUN)/checkpoint --distill-from $(TEACHER_RUN)/checkpoint --distill-weight 0.7 \
		--grid-sizes 20,24,28,28 --epochs 8 --lr 2e-4 --min-lr 1e-6 --warmup-epochs 0.25 --seed 1 \
		--name vit-fmnist --version 2 --out $(BUDGETS_RUN) --resume --no-progress \
		$(if $(THREADS),--threads $(THREADS)) $(if $(TIME_LIMIT),--time-limit $(TIME_LIMIT))

# --eval: the temperature of the served probabilities and the OOD score's statistics, fitted on half of
# Fashion-MNIST's test split and measured on the other half (docs/calibration.md, docs/ood-served.md)
FASHION_MNIST ?= /usr/share/datasets/fashion-mnist
export-default: $(VENV)/.dev-installed
	$(BIN)/vitserve export $(MODEL_DIR)/checkpoint --out $(DEFAULT_MODEL) --eval $(FASHION_MNIST)
	$(BIN)/vitserve export $(MODEL_DIR)/checkpoint --out $(MODEL_DIR)/model-int8.onnx --precision int8 \
		--eval $(FASHION_MNIST) --json > $(MODEL_DIR)/model-int8.export.json
	$(BIN)/vitserve evaluate calibration $(DEFAULT_MODEL) --eval $(FASHION_MNIST) --out docs/calibration.md
	$(BIN)/python -m vitserve.evaluation.ood --served --model $(DEFAULT_MODEL) --data-dir $(FASHION_MNIST) --out docs/ood-served.md

# Files the run as the section vit-fmnist of the committed docs/results/bench.md (bench/pages.py), on purpose;
# `vitserve bench` alone writes under build/bench/.
bench: $(VENV)/.dev-installed
	$(BIN)/vitserve bench --model $(DEFAULT_MODEL) --out build/bench/bench.md
	$(BIN)/python -m vitserve.bench.pages put docs/results/bench.md --section vit-fmnist build/bench/bench.md

# The docs' pictures of the web page (docs/web-*.png) and what each shows (docs/web-page.json), taken in headless
# Chromium from the page as it is, served on the bundled model; tests/service/test_web.py fails when the page no
# longer shows what they show. `python -m vitserve.bench.screenshots` alone writes under build/screenshots/.
screenshots: $(VENV)/.dev-installed
	$(BIN)/python -m vitserve.bench.screenshots --out docs

# Builds the images (offline, on a local debootstrapped base) and checks each from inside a container.
docker-test:
	bash docker/test.sh $(DOCKER_IMAGES)

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info

# The GPU kit (bench/gpu.py): exports fp32 and fp16, verifies them on the CUDA provider, CUDA graphs against the
# dynamic session, the maps-free fused graph, and a served run loaded by wrk on its own cores with the GPU's
# utilisation; installs onnxruntime-gpu into build/gpu/venv when a GPU is there and the build lacks CUDA. Without a
# GPU it checks itself on the default model and says what it skipped. GPU_ARGS adds flags. For a GPU machine without
# network access: `make gpu-wheels` on a machine with it, then `bash bench/gpu-offline.sh OUT` on the GPU machine
# (docs/results/bench-gpu.md, "How to run it").
.PHONY: bench-gpu gpu-wheels
bench-gpu: $(VENV)/.dev-installed
	$(BIN)/python -m vitserve.bench.gpu $(GPU_ARGS)

gpu-wheels: $(VENV)/.dev-installed
	$(BIN)/python -m vitserve.bench.gpu_wheels --out .whl --lzma --leave-out grpcio --max-mib 48

# vitserve side by side with Triton (nvidia-pytriton) and LitServe under Debian's wrk; files the run as the section
# PEERS_SECTION of the committed docs/results/bench-peers.md (bench/pages.py). Makes build/peers/venv-triton and
# build/peers/venv-litserve (pinned, bench/peers/venvs.py) when absent. PEERS_ARGS adds flags, e.g.
# PEERS_ARGS="--venv-python /usr/bin/python3 --rounds 2".
.PHONY: bench-peers
PEERS_SECTION ?= vit-fmnist
bench-peers: $(VENV)/.dev-installed
	@command -v wrk >/dev/null || { echo "bench-peers needs wrk: apt-get update && apt-get install -y wrk"; exit 1; }
	$(BIN)/python -m vitserve.bench.peers --out build/bench/peers.md $(PEERS_ARGS)
	$(BIN)/python -m vitserve.bench.pages put docs/results/bench-peers.md --section $(PEERS_SECTION) build/bench/peers.md

# Triton's gRPC protocol (service/grpc/generated/*.proto, copied unchanged from triton-inference-server/common
# at 83adf7c) compiled into the checked-in Python stubs; the serving image needs no compiler. protoc writes
# top-level imports (`import model_config_pb2`): they are made package imports, as tritonclient does.
GRPC_GENERATED := service/grpc/generated
grpc-stubs: $(VENV)/.dev-installed
	$(BIN)/python -m grpc_tools.protoc -I $(GRPC_GENERATED) --python_out=$(GRPC_GENERATED) \
		--pyi_out=$(GRPC_GENERATED) --grpc_python_out=$(GRPC_GENERATED) \
		$(GRPC_GENERATED)/grpc_service.proto $(GRPC_GENERATED)/model_config.proto
	sed -i -E 's/^import (model_config_pb2|grpc_service_pb2) as/from vitserve.service.grpc.generated import \1 as/' \
		$(GRPC_GENERATED)/*_pb2*.py $(GRPC_GENERATED)/*.pyi
	rm -f $(GRPC_GENERATED)/model_config_pb2_grpc.py
