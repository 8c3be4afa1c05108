"""The cheap length bound on the project's real tokenizers (tiny Qwen3.5's, SmolLM2's): a
prompt whose bytes alone prove it longer than `max_tokens` is refused before it is encoded
(issue 22, finding 2), and the bound is a bound, hostile text included. The rule itself, on
tokenizers built here, is in test_length_bound.py (fast, for its mutation grid)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_control_tokens import EXAMPLES, smollm2_tokenizer  # noqa: F401  (a fixture)
from tiny_models import byte_tokenizer

from semif_serve.scoring import PromptRejected, parse_row, shared_prompts
from semif_serve.scoring import prompt as prompt_module
from semif_serve.scoring.length_bound import bytes_per_token, fewest_tokens
from semif_serve.scoring.prompt import encode_prompt


def huge_row(megabytes: int = 16) -> dict:
    text = "evidence " * (megabytes * (1 << 20) // 9)
    options = [{"id": f"o{k}", "description": text[: len(text) // 16]} for k in range(16)]
    return {"id": "huge", "state": "s", "question": "Which?", "options": options}


@pytest.fixture
def no_encoding(monkeypatch):
    """Fails the test if any prompt reaches the tokenizer's encoding (the layout stage)."""

    def refuse(*args, **kwargs):
        raise AssertionError("the prompt was encoded")

    monkeypatch.setattr(prompt_module, "layout", refuse)
    monkeypatch.setattr(shared_prompts, "layout", refuse)


def test_an_absurd_prompt_is_refused_from_its_bytes_without_encoding(qwen_tokenizer, no_encoding):
    """[22.2] 16 options of 1 MB: refused before the tokenizer runs (it took 45 s before)."""
    huge = parse_row(huge_row())
    with pytest.raises(PromptRejected, match=r"^max_tokens: the prompt has at least \d+ tokens"):
        encode_prompt(qwen_tokenizer, huge, 4096)
    with pytest.raises(PromptRejected, match=r"^rows\[0\]: max_tokens: the prompt has at least"):
        shared_prompts.encode_shared(qwen_tokenizer, [huge], 4096)
    with pytest.raises(PromptRejected, match="at least") as refused:
        shared_prompts.encode_with_prefix(qwen_tokenizer, huge, 4096)
    assert refused.value.row_index is None  # a direct refusal names no row


def test_the_bound_names_the_first_row_too_long(qwen_tokenizer, no_encoding):
    rows = [parse_row({**huge_row(1), "id": "a"}), parse_row({**huge_row(2), "id": "b"})]
    with pytest.raises(PromptRejected) as refused:
        shared_prompts.encode_shared(qwen_tokenizer, rows, 100)
    assert refused.value.row_index == 0


def test_bytes_per_token_of_the_project_tokenizers(qwen_tokenizer, smollm2_tokenizer):  # noqa: F811
    assert bytes_per_token(qwen_tokenizer) == 256 * 3  # its longest entry; NFC shrinks by 3
    assert bytes_per_token(smollm2_tokenizer) is not None
    assert bytes_per_token(byte_tokenizer()) == 2  # "Ġ" spells one byte in two: a safe bound


HOSTILE = [
    " " * 3000,  # the longest entries are whitespace runs
    "-" * 3000,
    "\u1100\u1161\u11a8" * 300,  # Hangul jamo: NFC composes three 3-byte ones into one
    "\U0001d400" * 300,  # a 4-byte mathematical letter
    "\u212a" * 300,  # the Kelvin sign
    "e\u0301" * 500,
]


@given(data=st.data())
@EXAMPLES
def test_no_text_encodes_to_fewer_tokens_than_the_bound(tokenizer, data):
    """The bound is a bound: the real encoding of drawn (and hostile) text is never shorter."""
    text = data.draw(
        st.lists(
            st.one_of(st.sampled_from(HOSTILE), st.text(st.characters(exclude_categories=("Cs",)))),
            max_size=4,
        ).map("".join)
    )
    bound = bytes_per_token(tokenizer)
    assert bound is not None
    assert len(tokenizer.encode(text, add_special_tokens=False)) >= fewest_tokens(text, bound)


@pytest.fixture(scope="module", params=["qwen35", "smollm2"])
def tokenizer(request):
    return request.getfixturevalue(
        "qwen_tokenizer" if request.param == "qwen35" else "smollm2_tokenizer"
    )
