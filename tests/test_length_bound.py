"""The cheap length bound's rule (issue 22, finding 2) on tokenizers built here, fast enough for
its mutation grid: which tokenizers have a bound (every byte kept: byte-level or byte-fallback
BPE, splitting pre-tokenizers, normalisers that shrink text by a known factor) and its value;
the guard that refuses a rendered prompt from its bytes. The project's real tokenizers:
test_length_bound_real.py."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from semif_serve.scoring import PromptRejected
from semif_serve.scoring.length_bound import bytes_per_token, fewest_tokens
from semif_serve.scoring.prompt import check_fewest_tokens


def test_fewest_tokens_rounds_up():
    assert fewest_tokens("", 4) == 0
    assert fewest_tokens("abcd", 4) == 1
    assert fewest_tokens("abcde", 4) == 2
    assert fewest_tokens("é", 1) == 2  # bytes, not characters


def fast(normalizer=None, pre_tokenizer=None, model=None) -> PreTrainedTokenizerFast:
    vocab = {"a": 0, "b": 1, "ab": 2, "[UNK]": 3}
    backend = Tokenizer(
        model or models.BPE(vocab, [("a", "b")], unk_token="[UNK]", byte_fallback=True)
    )
    backend.normalizer = normalizer
    backend.pre_tokenizer = pre_tokenizer
    return PreTrainedTokenizerFast(tokenizer_object=backend)


@pytest.mark.parametrize(
    ("build", "expected"),
    [
        (lambda: fast(), 5),  # "[UNK]" is the longest entry
        (lambda: fast(normalizers.NFKC()), 20),
        (lambda: fast(normalizers.Sequence([normalizers.NFC(), normalizers.Lowercase()])), 45),
        (lambda: fast(normalizers.Replace(" ", "\u2581")), 5),
        (lambda: fast(normalizers.Replace("abcdef", "ab")), 15),
        (lambda: fast(normalizers.Replace("a", "")), None),  # deletes text
        (lambda: fast(normalizers.Strip()), None),
        (lambda: fast(normalizers.StripAccents()), None),
        (lambda: fast(normalizers.Sequence([normalizers.NFC(), normalizers.Strip()])), None),
        (lambda: fast(pre_tokenizer=pre_tokenizers.Whitespace()), None),  # drops spaces
        (lambda: fast(pre_tokenizer=pre_tokenizers.Metaspace()), 5),
        (
            lambda: fast(
                pre_tokenizer=pre_tokenizers.Sequence(
                    [pre_tokenizers.Digits(), pre_tokenizers.Split(" ", "removed")]
                )
            ),
            None,
        ),
        (lambda: fast(model=models.BPE({"a": 0}, [], unk_token="a")), None),  # no byte fallback
        (lambda: fast(model=models.WordPiece({"a": 0, "[UNK]": 1}, unk_token="[UNK]")), None),
    ],
)
def test_only_tokenizers_that_keep_every_byte_have_a_bound(build, expected):
    assert bytes_per_token(build()) == expected


def test_a_tokenizer_without_a_fast_backend_has_no_bound():
    assert bytes_per_token(object()) is None


def test_the_guard_refuses_the_first_text_its_bytes_prove_too_long():
    tokenizer = fast(normalizers.NFC())  # 15 bytes a token at most
    check_fewest_tokens(tokenizer, ["a" * 150, "b" * 30], 10)  # exactly 10: allowed
    with pytest.raises(PromptRejected) as refused:
        check_fewest_tokens(tokenizer, ["a" * 150, "b" * 151, "c" * 999], 10)
    assert refused.value.row_index == 1
    assert str(refused.value) == (
        "max_tokens: the prompt has at least 11 tokens, over the limit of 10 (prompts are never "
        "truncated)"
    )
    check_fewest_tokens(fast(normalizers.Strip()), ["x" * 10_000], 1)  # no bound: no refusal


def test_a_tokenizer_is_scanned_once():
    tokenizer = fast()
    backend = tokenizer.backend_tokenizer
    assert bytes_per_token(tokenizer) == 5
    tokenizer._tokenizer = None  # a second scan would fail
    assert bytes_per_token(tokenizer) == 5
    tokenizer._tokenizer = backend


@pytest.mark.parametrize(
    ("pre_tokenizer", "expected"),
    [
        (pre_tokenizers.ByteLevel(), 5),  # every byte has its symbol: no byte fallback needed
        (pre_tokenizers.Sequence([pre_tokenizers.Digits(), pre_tokenizers.ByteLevel()]), 5),
        (pre_tokenizers.Sequence([pre_tokenizers.Digits(), pre_tokenizers.Metaspace()]), None),
        (pre_tokenizers.Metaspace(), None),  # no byte-level step and no byte fallback
        (None, None),
    ],
)
def test_without_byte_fallback_only_a_byte_level_step_gives_a_bound(pre_tokenizer, expected):
    vocab = {"a": 0, "b": 1, "ab": 2, "[UNK]": 3}
    model = models.BPE(vocab, [("a", "b")], unk_token="[UNK]", byte_fallback=False)
    assert bytes_per_token(fast(pre_tokenizer=pre_tokenizer, model=model)) == expected


def test_added_tokens_count_towards_the_longest_entry():
    tokenizer = fast()
    tokenizer.add_tokens(["<|a long added token|>"])
    assert bytes_per_token(tokenizer) == len("<|a long added token|>")


def test_an_empty_vocabulary_has_no_bound():
    assert bytes_per_token(fast(model=models.BPE({}, [], byte_fallback=True))) is None


class Unreferenceable:
    """A tokenizer wrapper that cannot be weakly referenced (no cache entry: computed each time)."""

    __slots__ = ("backend_tokenizer",)

    def __init__(self, backend):
        self.backend_tokenizer = backend


def test_a_tokenizer_that_cannot_be_cached_is_still_bounded():
    assert bytes_per_token(Unreferenceable(fast(normalizers.NFKC()).backend_tokenizer)) == 20
