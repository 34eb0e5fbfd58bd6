"""JIT build of the same sources through torch.utils.cpp_extension.load (cached on disk)."""
import os

from . import _build


def load(verbose=False):
    """Builds (or reuses the cached build of) the extension and returns the loaded module.

    The build cache lives in $FUSEDOPS_JIT_DIR, else torch's extensions folder.
    """
    if not _build.sources():
        raise RuntimeError(f"fusedops: JIT needs a source checkout; no CUDA sources under {_build.CSRC}")
    if _build.configure_cuda_home() is None:
        raise RuntimeError(_build.NO_TOOLKIT_MESSAGE)
    import torch.utils.cpp_extension as cpp_extension

    cpp_extension.CUDA_HOME = os.environ["CUDA_HOME"]
    archs = _build.arch_list()
    os.environ["TORCH_CUDA_ARCH_LIST"] = archs
    cxx_flags, nvcc_flags = _build.compile_args(archs)
    build_dir = os.environ.get("FUSEDOPS_JIT_DIR")
    if build_dir:
        os.makedirs(build_dir, exist_ok=True)
    return cpp_extension.load(
        name="fusedops_jit",
        sources=_build.sources(),
        extra_cflags=cxx_flags,
        extra_cuda_cflags=nvcc_flags,
        build_directory=build_dir,
        verbose=verbose,
    )
