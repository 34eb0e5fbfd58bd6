"""An install without the compiled extension: importing fusedops still works, build_info() says
why nothing is loaded, and every op raises a clear error instead of a confusing import failure."""
import os
import shutil
import subprocess
import sys

import fusedops

_PROBE = """
import fusedops, torch
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
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    env.pop("FUSEDOPS_JIT", None)
    run = subprocess.run([sys.executable, "-c", _PROBE], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    build, error, raised = run.stdout.splitlines()[:3]
    assert build == "none"
    assert "No module named 'fusedops._C'" in error
    assert "circular import" not in error
    assert "extension is not available" in raised and "pip install" in raised
