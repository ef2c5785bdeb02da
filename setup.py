"""Optional ahead-of-time build of the csrc/ extension.

``pip install .`` works without it: the extension is otherwise built with ninja
at first use (``rlkernels._extension``). Set ``RLKERNELS_BUILD_EXT=1`` to build it
now; torch must already be installed (it is never a build requirement).
"""
import os

from setuptools import setup

ext_modules, cmdclass = [], {}
if os.environ.get("RLKERNELS_BUILD_EXT") == "1":
    from rlkernels_build import extension_modules  # noqa: F401  (defined with the csrc sources)

    ext_modules, cmdclass = extension_modules()

setup(ext_modules=ext_modules, cmdclass=cmdclass)
