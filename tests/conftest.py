import os
import sys

# the repository root, so tests can import bench helpers and the package from a plain checkout
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
