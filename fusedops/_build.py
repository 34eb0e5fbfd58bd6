"""Build configuration shared by setup.py, fusedops.jit and (by convention) CMakeLists.txt.

Kept free of torch imports at module level so setup.py can load it by path before torch's
cpp_extension reads CUDA_HOME.
"""
import glob
import os
import shutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "csrc")
DEFAULT_ARCH_LIST = "8.0;9.0"


def sources():
    """Every .cpp and .cu under csrc/: adding a kernel file needs no edit here."""
    found = glob.glob(os.path.join(CSRC, "**", "*.cpp"), recursive=True)
    found += glob.glob(os.path.join(CSRC, "**", "*.cu"), recursive=True)
    return sorted(found)


def _is_toolkit(root):
    return os.path.isfile(os.path.join(root, "bin", "nvcc")) and os.path.isfile(
        os.path.join(root, "include", "cuda_runtime.h")
    )


def find_cuda_home():
    """The CUDA toolkit root, or None.

    torch guesses the root from `which nvcc`, which is wrong when nvcc on PATH is a wrapper
    script outside the toolkit (e.g. /usr/local/bin/nvcc): then it fails to link -lcudart.
    Candidates are therefore checked for a real toolkit layout.
    """
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    candidates.append("/usr/local/cuda")
    for root in candidates:
        if root and _is_toolkit(root):
            return root
    return None


def configure_cuda_home():
    """Sets CUDA_HOME for torch.utils.cpp_extension; returns it, or None without a toolkit."""
    root = find_cuda_home()
    if root:
        os.environ["CUDA_HOME"] = root
    return root


NO_TOOLKIT_MESSAGE = (
    "fusedops: no CUDA toolkit found. fusedops compiles CUDA kernels and needs nvcc and the "
    "CUDA headers (a toolkit matching torch.version.cuda). Install the CUDA toolkit, or set "
    "CUDA_HOME to its root (the folder holding bin/nvcc and include/cuda_runtime.h)."
)


def with_sm90a(archs):
    """The arch list with a plain 9.0 entry compiled as 9.0a (an sm_90a cubin: Hopper's wgmma
    kernels exist only there; it runs on sm_90 devices). "9.0+PTX" is kept as it is, so its PTX
    stays forward compatible; such a build uses the sm_80-style kernels on Hopper."""
    entries = archs.replace(" ", ";").split(";")
    return ";".join("9.0a" if entry == "9.0" else entry for entry in entries if entry)


def arch_list():
    """TORCH_CUDA_ARCH_LIST if set, else the visible GPU, else sm_80 + sm_90; 9.0 means 9.0a."""
    env = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if env:
        return with_sm90a(env)
    import torch

    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return with_sm90a(f"{major}.{minor}")
    return with_sm90a(DEFAULT_ARCH_LIST)


def _library_header_dirs(cuda_home):
    """A minimal toolkit may lack the cuBLAS/cuSPARSE headers that torch's CUDA headers include;
    the CUDA build of torch ships them under site-packages/nvidia/cu*/include. Searched after
    every other include dir, so the toolkit's own headers still win."""
    if cuda_home and os.path.isfile(os.path.join(cuda_home, "include", "cusparse.h")):
        return []
    import torch

    site = os.path.dirname(os.path.dirname(torch.__file__))
    # CUDA 13 wheels share one nvidia/cu13/include; CUDA 12 wheels have one folder per library.
    return sorted(glob.glob(os.path.join(site, "nvidia", "*", "include")))


def compile_args(archs):
    """(cxx flags, nvcc flags) for the given arch list. The C++ standard is torch's own."""
    # The arch list reaches C++ as one preprocessor token ("8.0_9.0"); build_info() turns it back.
    arch_define = "-DFUSEDOPS_ARCH_LIST=" + archs.replace(" ", ";").replace(";", "_")
    cxx = ["-O3", arch_define]
    for include in _library_header_dirs(find_cuda_home()):
        cxx += ["-idirafter", include]
    nvcc = ["-O3", "--expt-relaxed-constexpr", "-lineinfo"]
    return cxx, nvcc
