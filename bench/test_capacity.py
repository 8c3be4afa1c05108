"""Memory per extra row of a shared call at several prefix lengths, in the three layouts (packed:
attention-only models; shared-prefix: hybrid models; replicated: the fallback that copies the
prefix per row), and how many rows fit a budget. Each point is a fresh process (peak RSS only
grows)."""

import json
import subprocess
import sys
from pathlib import Path

from benchlib import FULL, model_source, report

PROBE = Path(__file__).parent / "capacity_probe.py"
BUDGET_GIB = 2.0  # the CPU budget the rows-that-fit figure is computed for


def probe(source, prefix_tokens, rows, layout):
    done = subprocess.run(
        [sys.executable, str(PROBE), source, str(prefix_tokens), str(rows), layout],
        capture_output=True,
        text=True,
        timeout=900,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_memory_per_row_by_prefix_length(bench_model, tmp_path):
    if FULL:
        source, prefixes, rows = "builtin:smollm2-135m", (140, 520, 1960, 3900), 16
    else:
        source, prefixes, rows = model_source(tmp_path, bench_model), (140,), 4
    figures = {}
    for layout in ("packed", "shared-prefix", "replicated"):
        for prefix in prefixes:
            one = probe(source, prefix, 1, layout)
            many = probe(source, prefix, rows, layout)
            per_row = max(0, many["peak_rss_bytes"] - one["peak_rss_bytes"]) / (rows - 1)
            headroom = BUDGET_GIB * (1 << 30) - one["peak_rss_bytes"]
            figures[f"{layout}@{prefix}"] = {
                "mib_per_extra_row": per_row / (1 << 20),
                "rows_fitting_budget": int(headroom // per_row) + 1 if per_row else None,
            }
    largest = prefixes[-1]
    one_copy = ("packed", "shared-prefix")
    shared = max(figures[f"{layout}@{largest}"]["mib_per_extra_row"] for layout in one_copy)
    replicated = figures[f"replicated@{largest}"]["mib_per_extra_row"]
    report(
        "capacity",
        f"memory per extra row, one prefix copy (packed or shared-prefix), {largest}-token prefix",
        "the replicated layout (a prefix copy per row)",
        shared / replicated if replicated else 0.0,
        budget_gib=BUDGET_GIB,
        points=figures,
    )
