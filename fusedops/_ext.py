"""Loads the compiled extension: the prebuilt fusedops._C (AOT), else a JIT build when
FUSEDOPS_JIT=1, else nothing (build_info() then says so and every op raises a clear error)."""
import importlib
import os

import torch

module = None
mode = "none"
load_error = None

try:
    # import_module rather than `from . import _C`: where _C was never built, the latter's error
    # blames a circular import; this one says "No module named 'fusedops._C'".
    module = importlib.import_module("._C", __package__)
    mode = "AOT"
except ImportError as error:  # no prebuilt extension in this install, or one that fails to load
    load_error = error
    if os.environ.get("FUSEDOPS_JIT") == "1":
        from . import jit

        module = jit.load()
        mode = "JIT"
        load_error = None


def available():
    return module is not None


def require():
    if module is None:
        raise RuntimeError(
            "fusedops: the compiled extension is not available "
            f"({load_error}). Build it with `pip install --no-build-isolation .`, or set "
            "FUSEDOPS_JIT=1 to compile it on import."
        )


def build_info():
    """Which build is loaded (AOT, JIT or none), its GPU architectures, and the torch and CUDA
    versions it was built with next to the ones running now."""
    info = {"build": mode, "torch_runtime": torch.__version__, "cuda_runtime": torch.version.cuda}
    if module is not None:
        built = dict(module.build_info())
        info["arch_list"] = built["arch_list"].split("_")
        info["torch_built"] = built["torch_version"]
        info["cuda_built"] = built["cuda_version"]
    else:
        info["error"] = str(load_error)
    return info
