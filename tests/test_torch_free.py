"""Issue 40: the HTTP layer, the runtime and the ecosystem formats import no torch (nor
transformers): the data path runs one way, and only the scorer and the engine know torch.
Each package's every module is imported in a fresh interpreter where importing torch fails."""

from __future__ import annotations

import subprocess
import sys

import pytest

IMPORT_ALL = """
import importlib, pkgutil, sys
for name in ("torch", "transformers", "numpy"):
    sys.modules[name] = None  # any import of it raises ImportError
package = importlib.import_module(sys.argv[1])
for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
    importlib.import_module(module.name)
print("imported", sys.argv[1])
"""


@pytest.mark.parametrize("package", ["semif_serve.http", "semif_serve.runtime", "semif_serve.apis"])
def test_the_package_imports_without_torch(package):
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_ALL, package], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == f"imported {package}"
