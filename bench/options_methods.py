"""More than 16 options: which way of reading option groups back answers best (docs/quality.md).

Every labelled decision of bench/data/decisions144.jsonl (3 options and a gold) is scored as it
is, directly: the reference answer. Then, for each size N, it becomes an N-option question: its
3 options at pseudo-random positions (seeded by row id and N, so a variant is the same on every
run; their order too) among N-3 distractors, other groups' rows' options. `apis.grouped` plans
it as groups of at most 16 options, rows of the same question over the row's state, scored in
one shared call of the real in-process scorer, and reads them back both ways:

- `grouped-16`: one softmax over every group's option logits;
- `tournament-16`: each group's winner in a final row (a second shared call);
  p(option) = p(option in its group) * p(its group's winner in the final).

Per (N, method): accuracy (top option == gold), agreement (top option == the direct answer's
top), mean probability on the gold option and on the 3 real options, mean rows and forward
tokens per question (each shared call's state prefix once plus its suffixes; no prefix cache),
and the commonest letter of the top option in its own row (how position-driven the model is).
Per N, the rows only one method gets right, or agrees on. Pure measurement: no assertions.

    python bench/options_methods.py --model smollm2 --sizes 17,40,64,255 --json OUT.json
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import re
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import semif_serve  # noqa: F401  (offline before torch/transformers load)
from semif_serve.apis import grouped
from semif_serve.apis.mapping import FORMAT_OPTION_LIMIT, Mapped, top
from semif_serve.quality.labelled import LabelledRow, read_labelled
from semif_serve.scoring.prompt import LETTERS
from semif_serve.scoring.rows import MAX_OPTIONS

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "bench" / "data" / "decisions144.jsonl"
MAX_TOKENS = 4096  # the server's default SEMIF_MAX_TOKENS
REAL = 3  # each labelled row's own options
ONE_RECORD = re.compile(r'\{\n *"id": [^{}]*\}')  # the results file: a line per record


def load(name: str):
    """The ScoringModel: SmolLM2-135M (built in, offline) or the tiny random Qwen3.5."""
    if name == "smollm2":
        from semif_serve.engine.loading import load_model

        return load_model("builtin:smollm2-135m")
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import qwen35_tokenizer, tiny_qwen35

    from semif_serve.scoring import ModelInfo, ScoringModel

    info = ModelInfo(source="test:tiny-qwen3.5", revision="seed-0", dtype="float32", device="cpu")
    return ScoringModel(model=tiny_qwen35(), tokenizer=qwen35_tokenizer(), info=info)


def distractor_pool(rows: list[LabelledRow]) -> list[tuple[str, dict[str, str]]]:
    """Every option of every row as (its row's group, a distractor option with a unique id)."""
    return [
        (row.group, {"id": f"x-{row.id}-{option['id']}", "description": option["description"]})
        for row in rows
        for option in row.row["options"]
    ]


def variant(labelled: LabelledRow, pool: list, size: int) -> list[dict[str, str]]:
    """`labelled`'s options at seeded random positions (and so in a seeded random order) among
    size-3 options of other groups' rows, each description once."""
    own = labelled.row["options"]
    texts = {option["description"] for option in own}
    others = {}  # short descriptions such as '240' recur: each once, and never one of ours
    for group, option in pool:
        if group != labelled.group and option["description"] not in texts:
            others.setdefault(option["description"], option)
    rng = random.Random(f"{labelled.id}:{size}")
    fillers = iter(rng.sample(list(others.values()), size - len(own)))
    positions = dict(zip(rng.sample(range(size), len(own)), own))
    return [positions[k] if k in positions else next(fillers) for k in range(size)]


def shared_call(model, state: Any, rows: list[Mapped], tag: str, tokens: list[int]):
    """Score planned rows over `state` in one shared call; adds its forward tokens to `tokens`."""
    from semif_serve.scoring import score_shared

    semif_rows = [
        {
            "id": f"{tag}-{index}",
            "state": state,
            "question": mapped.question,
            "options": [
                {"id": option_id, "description": text}
                for option_id, text in zip(mapped.option_fields, mapped.descriptions, strict=True)
            ],
        }
        for index, mapped in enumerate(rows)
    ]
    results, timing = score_shared(model, semif_rows, max_tokens=MAX_TOKENS)
    tokens.append(timing["prefix_tokens"] + timing["true_suffix_tokens"])
    return results


def letter(position: int, cut: list[range]) -> tuple[str, int]:
    """The letter an option has in its own row, and that row's group (0 for a direct row)."""
    group = next((k for k, rows in enumerate(cut) if position in rows), 0)
    return LETTERS[position - (cut[group].start if cut else 0)], group


def record(labelled: LabelledRow, size: int, method: str, probabilities, option_ids, cut, **cost):
    """What one answer says: its top option (and that option's letter and group), p(gold), the
    mass on the row's own 3 options, the sum of its probabilities; `cost`: rows, tokens."""
    position = top(probabilities)
    at, group = letter(position, cut)
    return {
        "id": labelled.id,
        "size": size,
        "method": method,
        "top": option_ids[position],
        "letter": at,
        "group": group,
        "p_gold": probabilities[option_ids.index(labelled.gold)],
        "p_real": sum(probabilities[option_ids.index(k)] for k in labelled.option_ids),
        "p_sum": sum(probabilities),
        **cost,
    }


def measure_row(model, labelled: LabelledRow, pool: list, sizes: list[int]) -> list[dict]:
    """The direct record of one row, then one record per (size, method)."""
    from semif_serve.scoring import parse_row, score

    direct = score(model, parse_row(labelled.row), max_tokens=MAX_TOKENS)
    ids, tokens = labelled.option_ids, direct["input_tokens"]
    records = [
        record(labelled, REAL, "direct", direct["probabilities"], ids, [], rows=1, tokens=tokens)
    ]
    state = labelled.row["state"]
    for size in sizes:
        options = variant(labelled, pool, size)
        option_ids = [option["id"] for option in options]
        question = Mapped(
            where=labelled.id,
            question=labelled.row["question"],
            descriptions=tuple(option["description"] for option in options),
            option_fields=tuple(option_ids),
        )
        layout = grouped.plan([question])
        shared: list[int] = []  # the forward tokens of each shared call
        results = shared_call(model, state, layout.rows, f"{labelled.id}-{size}", shared)
        for method in grouped.METHODS:
            calls = list(shared)  # the groups' call, then the final's for tournament-16
            tag = f"{labelled.id}-{size}-final"
            finals = functools.partial(shared_call, model, state, tag=tag, tokens=calls)
            answer = grouped.read_back([question], layout, results, method, finals=finals)[0]
            rows, tokens = len(layout.rows) + (method == grouped.TOURNAMENT), sum(calls)
            probabilities, cut = answer["probabilities"], layout.cuts[0]
            records.append(
                record(
                    labelled, size, method, probabilities, option_ids, cut, rows=rows, tokens=tokens
                )
            )
    for one in records:
        one["correct"] = one["top"] == labelled.gold
        one["agrees"] = one["top"] == records[0]["top"]
    return records


# summary field: the record field it averages
MEANS = {"accuracy": "correct", "agreement": "agrees", "gold_mass": "p_gold"}
MEANS |= {"real_mass": "p_real", "rows": "rows", "tokens": "tokens"}


def summarise(records: list[dict], sizes: list[int]) -> dict[str, Any]:
    """Means per (size, method), the direct baseline, and per size the paired counts."""

    def means(rows: list[dict], fields) -> dict[str, Any]:
        """The means, and how position-driven the answers are: the top's commonest letter."""
        (most, count), *_ = Counter(r["letter"] for r in rows).most_common(1)
        shown = {"questions": len(rows), "top_letter": most, "top_share": count / len(rows)}
        return shown | {
            name: statistics.fmean(float(r[MEANS[name]]) for r in rows) for name in fields
        }

    table, paired = [], []
    for size in sizes:
        for method in grouped.METHODS:
            rows = [r for r in records if r["size"] == size and r["method"] == method]
            table.append({"size": size, "method": method, **means(rows, MEANS)})
        by_id: dict[str, dict[str, dict]] = {}
        for r in records:
            if r["size"] == size and r["method"] != "direct":
                by_id.setdefault(r["id"], {})[r["method"]] = r
        pairs = [(p[grouped.SHARED_NORMALISER], p[grouped.TOURNAMENT]) for p in by_id.values()]
        paired.append(
            {
                "size": size,
                "both_right": sum(g["correct"] and t["correct"] for g, t in pairs),
                "only_grouped": sum(g["correct"] and not t["correct"] for g, t in pairs),
                "only_tournament": sum(t["correct"] and not g["correct"] for g, t in pairs),
                "agrees_only_grouped": sum(g["agrees"] and not t["agrees"] for g, t in pairs),
                "agrees_only_tournament": sum(t["agrees"] and not g["agrees"] for g, t in pairs),
                "same_top": sum(g["top"] == t["top"] for g, t in pairs),
            }
        )
    direct = [r for r in records if r["method"] == "direct"]
    return {
        "direct": means(direct, ("accuracy", "gold_mass", "tokens")),
        "methods": table,
        "paired": paired,
    }


def markdown(report: dict[str, Any]) -> str:
    direct = report["direct"]
    lines = [
        f"direct ({REAL} options, {direct['questions']} rows): accuracy {direct['accuracy']:.3f}, "
        f"p(gold) {direct['gold_mass']:.3f}, {direct['tokens']:.0f} tokens, top letter "
        f"{direct['top_letter']} in {direct['top_share']:.0%}",
        "",
        "| N | method | accuracy | agreement | p(gold) | p(real 3) | rows | tokens | top letter |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for m in report["methods"]:
        lines.append(
            f"| {m['size']} | {m['method']} | {m['accuracy']:.3f} | {m['agreement']:.3f} | "
            f"{m['gold_mass']:.3f} | {m['real_mass']:.3f} | {m['rows']:.1f} | {m['tokens']:.0f} | "
            f"{m['top_letter']} {m['top_share']:.0%} |"
        )
    lines += [
        "",
        "| N | both right | right: only grouped-16 / only tournament-16 | agrees: only grouped-16 "
        "/ only tournament-16 | same top |",
        "|---|---|---|---|---|",
    ]
    for p in report["paired"]:
        lines.append(
            f"| {p['size']} | {p['both_right']} | {p['only_grouped']} / {p['only_tournament']} | "
            f"{p['agrees_only_grouped']} / {p['agrees_only_tournament']} | {p['same_top']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None, scoring_model=None) -> dict[str, Any]:
    """Measure, print the tables, and with --json store this model's report in that file
    (under `runs.<model>`, beside any other model's). `scoring_model` replaces the loaded one."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("smollm2", "tiny-qwen"), required=True)
    parser.add_argument("--sizes", default="17,40,64,255")
    parser.add_argument("--limit", type=int, default=None, help="the first N rows only")
    parser.add_argument("--stride", type=int, default=1, help="every Kth row (3: one per group)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    sizes = [int(size) for size in args.sizes.split(",")]
    if any(not MAX_OPTIONS < size <= FORMAT_OPTION_LIMIT for size in sizes):
        parser.error(f"--sizes: each size must be {MAX_OPTIONS + 1}..{FORMAT_OPTION_LIMIT}")
    model = scoring_model or load(args.model)
    every = read_labelled([DATA])
    pool = distractor_pool(every)  # distractors: from all rows, whatever is scored
    chosen = every[:: args.stride][: args.limit]
    started = time.perf_counter()
    records = []
    for number, labelled in enumerate(chosen, start=1):
        records += measure_row(model, labelled, pool, sizes)
        seconds = time.perf_counter() - started
        print(f"{number}/{len(chosen)} {labelled.id} {seconds:.0f} s", file=sys.stderr, flush=True)
    report = {
        "model": args.model,
        "identity": model.info.identity(),
        "data": str(DATA.relative_to(ROOT)),
        "sizes": sizes,
        "stride": args.stride,
        "limit": args.limit,
        "seconds": round(time.perf_counter() - started, 1),
        **summarise(records, sizes),
        "records": records,
    }
    print(markdown(report))
    if args.json is not None:
        stored = json.loads(args.json.read_text()) if args.json.exists() else {"runs": {}}
        stored["runs"][args.model] = report
        args.json.parent.mkdir(parents=True, exist_ok=True)
        text = ONE_RECORD.sub(
            lambda found: json.dumps(json.loads(found[0])), json.dumps(stored, indent=1)
        )
        args.json.write_text(text + "\n")
    return report


if __name__ == "__main__":
    main()
