#!/bin/sh
# Print the constraints to install with: the lock "$2", less its triton pin unless the venv of python "$1" holds
# a CPU build of torch (a CUDA torch pins the triton it was built with; before torch is installed, torch's own
# dependencies are pinned and triton is left to the torch that comes).
set -eu
if "$1" -c 'import sys, torch; sys.exit(1 if torch.version.cuda else 0)' 2>/dev/null; then
  cat "$2"
else
  grep -viE '^triton==' "$2"
fi
