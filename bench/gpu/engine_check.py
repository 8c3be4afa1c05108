"""GPU memory check for the engine (issue: torch engine). Run on a GPU host via engine_check.sh.

Builds the production engine from the SEMIF_* environment (VRAM cap, warm-up, baseline), then
measures, in one run:
- the post-warm-up baseline (reserved and allocated);
- the peak while scoring one decision whose prompt is close to SEMIF_MAX_TOKENS;
- the peak during, and the reserved memory after, a 64-decision shared burst, and whether the
  engine handed the burst's memory back (reserved <= baseline + 512 MiB).
Prints one JSON object. Exits 2 without a CUDA device.
"""

from __future__ import annotations

import json
import sys

import semif_serve  # noqa: F401  (offline first)

GIB = 1 << 30


def long_row(tokenizer, max_tokens: int) -> dict:
    """The decision with the longest state (repeated words) whose prompt fits max_tokens."""
    from semif_serve.scoring import parse_row
    from semif_serve.scoring.prompt import encode_prompt

    def row(words: int) -> dict:
        return {
            "id": "long",
            "state": " ".join(["evidence"] * words),
            "question": "Is the evidence relevant?",
            "options": [{"id": "yes", "description": "Yes"}, {"id": "no", "description": "No"}],
        }

    def fits(words: int) -> bool:
        try:
            encode_prompt(tokenizer, parse_row(row(words)), max_tokens)
            return True
        except ValueError:
            return False

    low, high = 1, 2
    while fits(high):
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return row(low)


def main() -> int:
    import torch

    from semif_serve.config import Settings
    from semif_serve.engine.boot import build_engine
    from semif_serve.scoring import parse_row

    if not torch.cuda.is_available():
        print("engine_check: no CUDA device", file=sys.stderr)
        return 2
    settings = Settings.from_env()
    engine = build_engine(settings)
    device = settings.device
    scorer = engine._scorer
    report = {
        "device": torch.cuda.get_device_name(device),
        "vram_cap_gib": settings.vram_cap_gib,
        "baseline_reserved_gib": engine.baseline_reserved / GIB,
        "baseline_allocated_gib": torch.cuda.memory_allocated(device) / GIB,
    }

    row = parse_row(long_row(scorer.scoring_model.tokenizer, settings.max_tokens))
    torch.cuda.reset_peak_memory_stats(device)
    result = engine.score(row)
    report["long_input_tokens"] = result["input_tokens"]
    report["long_peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB
    report["long_peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / GIB

    state = " ".join(["The report lists findings across many departments."] * 150)
    burst = [
        parse_row(
            {
                "id": f"d{i}",
                "state": state,
                "question": f"Does finding {i} need action?",
                "options": [{"id": "yes", "description": "Yes"}, {"id": "no", "description": "No"}],
            }
        )
        for i in range(64)
    ]
    torch.cuda.reset_peak_memory_stats(device)
    _, timing = engine.score_shared(burst)
    report["burst_prefix_tokens"] = timing["prefix_tokens"]
    report["burst_seconds"] = timing["total_seconds"]
    report["burst_peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB
    report["after_burst_reserved_gib"] = torch.cuda.memory_reserved(device) / GIB
    report["released_after_burst"] = torch.cuda.memory_reserved(
        device
    ) <= engine.baseline_reserved + 512 * (1 << 20)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
