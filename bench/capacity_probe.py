"""One measurement in a fresh process: peak RSS of one shared call (for bench/test_capacity.py).

Usage: python bench/capacity_probe.py MODEL PREFIX_TOKENS ROWS LAYOUT
(LAYOUT: packed|shared-prefix|replicated)
Prints {"peak_rss_bytes": ..., "baseline_rss_bytes": ...}. ru_maxrss only grows, so each
measurement needs its own process.
"""

import json
import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from workloads import make_workload  # noqa: E402

import semif_serve  # noqa: E402,F401
from semif_serve.engine.loading import load_model  # noqa: E402
from semif_serve.scoring import score_shared  # noqa: E402
from semif_serve.scoring import shared as shared_module  # noqa: E402


def rss_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


def main() -> None:
    source, prefix_tokens, rows, layout = (
        sys.argv[1],
        int(sys.argv[2]),
        int(sys.argv[3]),
        sys.argv[4],
    )
    model = load_model(source)
    if layout in ("shared-prefix", "replicated"):  # the hybrid-model path, and its fallback
        shared_module.is_pure_attention = lambda model: False
    if layout == "replicated":
        shared_module.enable_prefix_attention = lambda model: False
    [group] = make_workload(model.tokenizer, 1, rows, prefix_tokens)
    score_shared(model, group[:1], max_tokens=16384)  # warm every code path at one row
    baseline = rss_peak()
    score_shared(model, group, max_tokens=16384)
    print(json.dumps({"peak_rss_bytes": rss_peak(), "baseline_rss_bytes": baseline}))


if __name__ == "__main__":
    main()
