"""docs/behavior-contract.md: every linked test exists, and every matrix cell has one label."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).parent.parent
DOC = ROOT / "docs" / "behavior-contract.md"
LINK = re.compile(r"`(tests/[\w/]+\.py)::(test_\w+)`")
LABEL = re.compile(r"\*\*([DPU])\*\*")


def functions_in(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}


def test_every_linked_test_function_exists():
    links = LINK.findall(DOC.read_text())
    assert len(links) > 20
    missing = [f"{file}::{name}" for file, name in links if name not in functions_in(ROOT / file)]
    assert missing == []


def matrix_cells(heading: str = "## Operations × states") -> list[str]:
    text = DOC.read_text()
    table = text.split(heading, 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    return [cell for row in rows[1:] for cell in row.strip("|").split(" | ")[1:]]


def test_every_operation_state_cell_has_exactly_one_label_and_d_p_cells_link_a_test():
    cells = matrix_cells()
    assert len(cells) == 6 * 7
    for cell in cells:
        labels = LABEL.findall(cell)
        assert len(labels) == 1, cell
        if labels[0] in "DP":
            assert LINK.search(cell), cell


def test_the_stated_count_matches_the_matrix():
    labels = [LABEL.findall(cell)[0] for cell in matrix_cells()]
    counts = {label: labels.count(label) for label in "DPU"}
    stated = f"{counts['D']} D, {counts['P']} P, {counts['U']} U"
    assert f"Operations × states: {stated}" in DOC.read_text(), stated


def test_every_two_model_cell_has_one_label_and_the_count_is_stated():
    cells = matrix_cells("## Two models")
    assert len(cells) == 7 * 5
    labels = []
    for cell in cells:
        [label] = LABEL.findall(cell)
        if label in "DP":
            assert LINK.search(cell), cell
        labels.append(label)
    counts = {label: labels.count(label) for label in "DPU"}
    stated = f"Two models: {counts['D']} D, {counts['P']} P, {counts['U']} U"
    assert stated in DOC.read_text(), stated
