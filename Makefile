# `make demo` sets up and runs the main job on a shipped model; `make test` runs the tests.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# A CPU build of PyTorch for the whole-model tests (on the project's machines this version is on local disk).
TORCH  ?= torch==2.13.0
OUT    ?= out

.PHONY: setup setup-test demo test bench ops-table models clean fuzz

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.runtime: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.test: pyproject.toml $(VENV)/.runtime
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[test]"
	touch $@

setup: $(VENV)/.runtime
setup-test: $(VENV)/.test

demo: setup
	@mkdir -p $(OUT)
	$(BIN)/onnxgrad build-grad models/mlp.onnx -o $(OUT)/mlp_train.onnx --dim N=32
	$(BIN)/onnxgrad run $(OUT)/mlp_train.onnx --steps 3 --lr 0.1
	$(BIN)/onnxgrad build-grad models/transformer.onnx -o $(OUT)/transformer_train.onnx --dim N=32
	$(BIN)/onnxgrad mirror $(OUT)/transformer_train.onnx -o $(OUT)/transformer_mirror.onnx
	$(BIN)/onnxgrad memory $(OUT)/transformer_train.onnx $(OUT)/transformer_mirror.onnx --top 3

test: setup-test
	$(BIN)/python -m pytest -q

# Random graphs through build-grad + check, and mutated protobufs through the loader: FUZZ_EXAMPLES fresh
# examples of each (`make test` runs 400 fixed ones); prints the outcome counts, also in $(OUT)/fuzz_stats.json.
FUZZ_EXAMPLES ?= 2000
fuzz: setup-test
	@mkdir -p $(OUT)
	FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) FUZZ_STATS=$(OUT)/fuzz_stats.json $(BIN)/python -m pytest -q -s tests/test_fuzz.py

bench: setup
	$(BIN)/python bench/bench_build.py

models: setup
	$(BIN)/python models/make_models.py models

ops-table: setup
	$(BIN)/python -m onnxgrad.ops_table --update-readme README.md

clean:
	rm -rf $(OUT) .pytest_cache
