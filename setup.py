"""Optional ahead-of-time build of the csrc/ extension.

``pip install .`` works without it: the extension is otherwise built with ninja
at first use (``rlkernels._extension``). Set ``RLKERNELS_BUILD_EXT=1`` to build it
now, into ``rlkernels/_C*.so`` (loaded with ``torch.ops.load_library``): the C++
CPU kernels always, the CUDA kernels too when the installed torch has CUDA and
``nvcc`` is found. torch must already be installed (use
``pip install --no-build-isolation .``); it is never a build requirement.
"""
import os
import sys
import shutil

from setuptools import setup


def extension_modules():
    from torch.utils import cpp_extension
    import torch

    here = os.path.dirname(os.path.abspath(__file__))
    csrc = os.path.join("csrc")
    sources = [os.path.join(csrc, "advantages.cpp")]
    sys.path.insert(0, here)
    from rlkernels._extension import openmp_flags  # at::parallel_for's OpenMP pragma needs -fopenmp

    omp = openmp_flags()
    nvcc = cpp_extension.CUDA_HOME and os.path.exists(os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc"))
    with_cuda = torch.version.cuda is not None and bool(nvcc or shutil.which("nvcc"))
    if with_cuda:
        sources += [os.path.join(csrc, "advantages_cuda.cu"), os.path.join(csrc, "advantages_cuda_binding.cpp")]
        ext = cpp_extension.CUDAExtension(
            "rlkernels._C",
            sources,
            include_dirs=[os.path.join(here, csrc)],
            extra_compile_args={"cxx": ["-O3", "-DRLKERNELS_WITH_CUDA", *omp], "nvcc": ["-O3", "--use_fast_math"]},
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
