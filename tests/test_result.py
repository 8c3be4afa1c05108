"""The result dict: float64 probabilities of the float32 letter logits, SemIf's readout per
scorer, a human summary, and the model block (identity, attention, library versions)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from semif_serve.scoring import ModelInfo, parse_row
from semif_serve.scoring.prompt import EncodedPrompt
from semif_serve.scoring.result import READOUTS, build_result, letter_probabilities

# Every finite float32, so magnitudes up to 3.4e38 (and logit gaps up to twice that) come up.
FLOAT32_LOGITS = st.lists(
    st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=2, max_size=16
)


def reference_softmax(logits: list[float]) -> list[float]:
    """Softmax in double with math.exp, largest logit subtracted first."""
    top = max(logits)
    exps = [math.exp(value - top) for value in logits]
    return [value / sum(exps) for value in exps]


def build(logits, scorer="direct", options=("Yes", "No")):
    row = parse_row(
        {
            "id": "r1",
            "state": "s",
            "question": "q?",
            "options": [{"id": f"o{k}", "description": text} for k, text in enumerate(options)],
        }
    )
    return build_result(
        row,
        EncodedPrompt("prompt", [1, 2, 3], [7] * len(options)),
        torch.tensor(logits, dtype=torch.float32),
        scorer=scorer,
        model={"source": "test"},
        forward_seconds=0.5,
        total_seconds=0.75,
    )


@settings(max_examples=300, deadline=None)
@given(FLOAT32_LOGITS)
def test_probabilities_are_the_float64_softmax_of_the_float32_logits(values):
    logits = torch.tensor(values, dtype=torch.float32)
    probabilities = letter_probabilities(logits)
    assert probabilities.dtype == torch.float64
    as_list = probabilities.tolist()
    assert abs(sum(as_list) - 1) < 1e-9  # upstream SemIf's own check
    assert as_list == pytest.approx(reference_softmax(logits.tolist()), rel=1e-12, abs=1e-300)


def test_a_float32_softmax_would_miss_semifs_sum_check():
    # The reason for float64: in float32 these logits' probabilities sum to 1 - 4.5e-8.
    logits = torch.tensor([0.3, -1.7, 2.2, 0.9, -0.4, 1.1, 0.0], dtype=torch.float32)
    assert abs(sum(torch.softmax(logits, dim=-1).tolist()) - 1) >= 1e-9
    assert abs(sum(letter_probabilities(logits).tolist()) - 1) < 1e-9


def test_option_logits_stay_float32_and_probabilities_are_computed_from_them():
    result = build([0.1, 0.2])
    float32 = [float(torch.tensor(value, dtype=torch.float32)) for value in (0.1, 0.2)]
    assert result["option_logits"] == float32 != [0.1, 0.2]
    assert result["probabilities"] == pytest.approx(reference_softmax(float32), rel=1e-15)


def test_readout_is_semifs_fixed_method_description_per_scorer():
    assert READOUTS == {
        "direct": "native full-vocabulary last-position logits restricted to declared answer slots",
        "shared": "native selected suffix-position logits",
    }
    assert build([1.0, 0.0])["readout"] == READOUTS["direct"]
    assert build([1.0, 0.0], scorer="shared")["readout"] == READOUTS["shared"]
    with pytest.raises(KeyError):
        build([1.0, 0.0], scorer="other")


def test_summary_names_the_top_letter_its_option_and_probability():
    result = build([0.0, 2.0, 1.0], options=("Red", "Green", "Blue"))
    assert result["summary"] == "B (o1) p=0.665 over 3 option letters, one forward pass"


def test_the_result_has_every_key_in_order():
    assert list(build([1.0, 0.0])) == [
        "id",
        "option_ids",
        "probabilities",
        "option_logits",
        "input_tokens",
        "forward_seconds",
        "total_seconds",
        "prompt_sha256",
        "prompt_version",
        "model",
        "readout",
        "summary",
        "probability_status",
    ]


def test_the_model_block_reports_attention_but_the_identity_does_not():
    info = ModelInfo(source="s", revision="r", dtype="float32", device="cpu", attention="eager")
    assert info.identity() == {"source": "s", "revision": "r", "dtype": "float32", "device": "cpu"}
    block = info.as_dict()
    assert block["attention"] == "eager"
    assert set(block) == {*info.identity(), "attention", "torch_version", "transformers_version"}
    assert ModelInfo("s", "r", "float32", "cpu").attention == "sdpa"
