"""AOT build of fusedops._C. Usage: pip install --no-build-isolation .  (or python setup.py install)

Architectures: TORCH_CUDA_ARCH_LIST, else the visible GPU, else sm_80 + sm_90. MAX_JOBS sets the
number of parallel compile jobs (ninja).
"""
import importlib.util
import os

from setuptools import find_packages, setup

_spec = importlib.util.spec_from_file_location(
    "fusedops_build", os.path.join(os.path.dirname(os.path.abspath(__file__)), "fusedops", "_build.py")
)
build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build)

if build.configure_cuda_home() is None:
    raise SystemExit(build.NO_TOOLKIT_MESSAGE)

from torch.utils.cpp_extension import BuildExtension, CUDAExtension  # noqa: E402  (after CUDA_HOME is set)

archs = build.arch_list()
os.environ["TORCH_CUDA_ARCH_LIST"] = archs
cxx_flags, nvcc_flags = build.compile_args(archs)

setup(
    name="fusedops",
    version="0.1.0",
    description="Fused CUDA kernels for PyTorch transformer training and inference",
    packages=find_packages(include=["fusedops", "fusedops.*"]),
    ext_modules=[
        CUDAExtension(
            name="fusedops._C",
            sources=[os.path.relpath(s) for s in build.sources()],
            extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
        )
    ],
    cmdclass={"build_ext": BuildExtension},
    python_requires=">=3.9",
    install_requires=["torch>=2.5", "numpy"],
)
