"""Optional ahead-of-time build of the csrc/ extension.

``pip install .`` works without it: the extension is otherwise built with ninja
at first use (``rlkernels._extension``). Set ``RLKERNELS_BUILD_EXT=1`` to build it
now, into ``rlkernels/_C*.so`` (loaded with ``torch.ops.load_library``): the C++
CPU kernels always, the CUDA kernels too when the installed torch has CUDA,
``nvcc`` is found and there is a target: a visible GPU, or ``TORCH_CUDA_ARCH_LIST``
(e.g. ``"8.0;9.0"``) on a machine without one. torch must already be installed (use
``pip install --no-build-isolation .``); it is never a build requirement.
"""
import os
import sys

from setuptools import setup


def extension_modules():
    from torch.utils import cpp_extension

    here = os.path.dirname(os.path.abspath(__file__))
    csrc = os.path.join("csrc")
    sources = [os.path.join(csrc, "advantages.cpp")]
    sys.path.insert(0, here)
    # the JIT build's rules: -fopenmp for at::parallel_for's pragma; CUDA kernels with a CUDA torch, nvcc and a
    # target (a visible GPU or TORCH_CUDA_ARCH_LIST, e.g. "8.0;9.0" for a wheel built on a machine without one)
    from rlkernels._extension import CUDA_FLAGS, CUDA_SOURCES, cuda_build_possible, openmp_flags

    omp = openmp_flags()
    if cuda_build_possible():
        sources += [os.path.join(csrc, name) for name in CUDA_SOURCES]
        ext = cpp_extension.CUDAExtension(
            "rlkernels._C",
            sources,
            include_dirs=[os.path.join(here, csrc)],
            extra_compile_args={"cxx": ["-O3", "-DRLKERNELS_WITH_CUDA", *omp], "nvcc": list(CUDA_FLAGS)},
            extra_link_args=omp,
        )
    else:
        ext = cpp_extension.CppExtension("rlkernels._C", sources, extra_compile_args={"cxx": ["-O3", *omp]},
                                         extra_link_args=omp)
    return [ext], {"build_ext": cpp_extension.BuildExtension.with_options(no_python_abi_suffix=True)}


ext_modules, cmdclass = [], {}
if os.environ.get("RLKERNELS_BUILD_EXT") == "1":
    ext_modules, cmdclass = extension_modules()

setup(ext_modules=ext_modules, cmdclass=cmdclass)
