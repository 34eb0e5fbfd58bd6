"""An install without the compiled extension: importing fusedops still works, build_info() says
why nothing is loaded, and every op raises a clear error instead of a confusing import failure."""
import os
import shutil
import subprocess
import sys

import fusedops

# The probe runs in the copy's directory, first on `python -c`'s sys.path. An editable install
# (`pip install -e .`, the README's way) adds a finder that maps fusedops back to the source tree
# ahead of sys.path: the probe drops it so that it imports the copy.
_PROBE = """
import sys
sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
import fusedops, torch
print(fusedops.__file__)
info = fusedops.build_info()
print(info["build"])
print(info["error"])
try:
    fusedops.softmax(torch.ones(2, 3))
except RuntimeError as error:
    print(error)
"""


def test_missing_extension_is_reported(tmp_path):
    package = os.path.dirname(fusedops.__file__)
    shutil.copytree(package, tmp_path / "fusedops",
                    ignore=shutil.ignore_patterns("_C*", "__pycache__"))
    env = {k: v for k, v in os.environ.items() if k != "FUSEDOPS_JIT"}
    run = subprocess.run([sys.executable, "-c", _PROBE], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    location, build, error, raised = run.stdout.splitlines()[:4]
    assert location.startswith(str(tmp_path)), location
    assert build == "none"
    assert "No module named 'fusedops._C'" in error
    assert "circular import" not in error
    assert "extension is not available" in raised and "pip install" in raised
