"""docs/configuration.md lists every SEMIF_* variable the server reads (outside the mutation
grids' test selection: mutmut's copy of the tree has no docs/)."""

import re
from pathlib import Path

from test_config_env import ONE_VARIABLE

ROOT = Path(__file__).resolve().parent.parent


def test_docs_configuration_lists_exactly_the_variables_the_server_reads():
    read = set(re.findall(r'"(SEMIF_[A-Z_]+)"', (ROOT / "semif_serve/config.py").read_text()))
    documented = set(re.findall(r"`(SEMIF_[A-Z_]+)`", (ROOT / "docs/configuration.md").read_text()))
    assert read == {variable for variable, *_ in ONE_VARIABLE} | {
        "SEMIF_API_TOKEN",
        "SEMIF_CALIBRATION",
    }
    assert read <= documented, f"undocumented: {sorted(read - documented)}"
