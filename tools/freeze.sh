#!/bin/sh
# Print the lock file: exact versions of everything installed in the venv of python "$1", except torch, the
# CUDA runtime wheels that come with a CUDA torch, and rlkernels itself (torch comes from the Makefile's TORCH).
set -eu
echo "# Exact versions the test suite last passed with; written by 'make lock', read by 'make test' and 'make demo'."
echo "# torch is not here (Makefile: TORCH). Edit only through 'make lock'."
"$1" -m pip freeze --all --exclude-editable \
  | grep -viE '^(torch|nvidia-[a-z0-9-]+|cuda-[a-z0-9-]+|rlkernels)==' \
  | LC_ALL=C sort -f
