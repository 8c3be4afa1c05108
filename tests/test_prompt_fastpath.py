"""The encoding shortcuts equal the full computations, on every tokenizer the project meets.

- The answer-boundary guard re-encodes only a prompt's tail (`check_answer_boundary`): it must
  accept and reject exactly as re-encoding every whole prompt + letter (`reference_boundary`).
- The shared call reuses row 0's tokens before a cut (`encode_common`): every row's ids must be
  a full `encode` of its text, and `encode_shared` must give what the algorithm before the
  shortcuts gave (`reference_encode_shared`), prompts, prefix and rejections alike.
Texts are adversarial: added tokens and near misses, whitespace runs, combining marks (NFC),
Hangul jamo, digits, `}]}`, quotes, backslashes, emoji, non-ASCII letters, near-empty states.
`reference_*` are also the "before" side of bench/test_encode_speed.py. A row whose text holds
an added token's text has its user turn encoded as plain text (`reference_ids`; see
tests/test_control_tokens.py), every other prompt is encoded whole.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import byte_symbols, byte_tokenizer
from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from semif_serve.scoring import prompt as prompt_module
from semif_serve.scoring import shared_prompts
from semif_serve.scoring.prompt import (
    LETTERS,
    EncodedPrompt,
    PromptRejected,
    check_answer_boundary,
    check_fewest_tokens,
    check_length,
    encode,
    encode_many,
    letter_token_ids,
    render,
    state_head,
    user_message,
)
from semif_serve.scoring.rows import Option, Row, as_row
from semif_serve.scoring.shared_prompts import (
    QWEN2_SPLIT,
    QWEN35_SPLIT,
    check_shared_rows,
    common_length,
    cut_margin,
    encode_common,
    encode_shared,
    shared_prefix,
    state_head_end,
)


def holds_added_text(tokenizer, message: str) -> bool:
    return any(token.content in message for token in tokenizer.added_tokens_decoder.values())


def reference_ids(tokenizer, text: str, message: str) -> list[int]:
    """A rendered prompt's ids (or a prompt + letter's, or a prompt's start): its whole text
    encoded, except that when the user message holds an added token's text, the user turn
    ("user\n" + message, after the template's <|im_start|>) is encoded as plain text with
    transformers' own `split_special_tokens=True` (every added token of the tokenizers here is
    special) and the template's text around it as usual."""
    if not holds_added_text(tokenizer, message):
        return encode(tokenizer, text)
    start = text.index("<|im_start|>user\n") + len("<|im_start|>")
    stop = min(len(text), start + len("user\n") + len(message))
    turn = tokenizer.encode(text[start:stop], add_special_tokens=False, split_special_tokens=True)
    return encode(tokenizer, text[:start]) + turn + encode(tokenizer, text[stop:])


def reference_encode_texts(tokenizer, texts, messages=None) -> list[list[int]]:
    """`reference_ids` of each text (messages[i]: text i's user message; None: encode whole)."""
    ids = encode_many(tokenizer, texts)
    for index, message in enumerate(messages or []):
        if holds_added_text(tokenizer, message):
            ids[index] = reference_ids(tokenizer, texts[index], message)
    return ids


def reference_boundary(tokenizer, texts, ids, letter_ids, messages=None) -> None:
    """The answer-boundary guard before the shortcut: every whole prompt + letter encoded."""
    probes = [
        (index, letter, letter_id)
        for index, row_letters in enumerate(letter_ids)
        for letter, letter_id in zip(LETTERS, row_letters)
    ]
    encoded = reference_encode_texts(
        tokenizer,
        [texts[index] + letter for index, letter, _ in probes],
        None if messages is None else [messages[index] for index, _, _ in probes],
    )
    for (index, letter, letter_id), with_letter in zip(probes, encoded):
        if with_letter != ids[index] + [letter_id]:
            raise PromptRejected(
                f"answer boundary guard: prompt + {letter!r} does not encode as the prompt's "
                "tokens followed by the letter's token",
                row_index=index,
            )


def _indexed(index, check, *args):
    try:
        return check(*args)
    except PromptRejected as error:
        raise PromptRejected(str(error), row_index=index) from None


def reference_encode_prompts(tokenizer, rows, max_tokens) -> list[EncodedPrompt]:
    """`encode_prompts` before the shortcuts: every prompt encoded whole, every guard. The
    cheap length bound (issue 22) runs first, as it does in production: it is not a shortcut
    of encoding (tests/test_length_bound.py checks it), and a prompt it refuses is refused
    with its "at least N tokens" message before anything is encoded."""
    texts = [_indexed(index, render, tokenizer, row) for index, row in enumerate(rows)]
    check_fewest_tokens(tokenizer, texts, max_tokens)
    messages = [user_message(row) for row in rows]
    ids = reference_encode_texts(tokenizer, texts, messages)
    for index, row_ids in enumerate(ids):
        _indexed(index, check_length, row_ids, max_tokens)
    by_count: dict[int, list[int]] = {}
    letter_ids = []
    for index, row in enumerate(rows):
        if len(row.options) not in by_count:
            by_count[len(row.options)] = _indexed(
                index, letter_token_ids, tokenizer, len(row.options)
            )
        letter_ids.append(by_count[len(row.options)])
    reference_boundary(tokenizer, texts, ids, letter_ids, messages)
    return [EncodedPrompt(*fields) for fields in zip(texts, ids, letter_ids)]


def reference_encode_shared(tokenizer, rows, max_tokens):
    """`encode_shared` before the shortcuts: each row encoded whole, the state head on its own."""
    parsed = check_shared_rows([as_row(row) for row in rows])
    try:
        prompts = reference_encode_prompts(tokenizer, parsed, max_tokens)
    except PromptRejected as error:
        index = error.row_index
        raise PromptRejected(f"rows[{index}]: {error}", row_index=index) from None
    text = prompts[0].text
    position = text.find(user_message(parsed[0]))
    if position < 0:
        raise PromptRejected(
            "shared prefix guard: the chat template changed the user message, so the state "
            "prefix cannot be located"
        )
    head = text[: position + len(state_head(parsed[0]))]
    prefix_ids = reference_ids(tokenizer, head, user_message(parsed[0]))[:-1]
    if not prefix_ids:
        raise PromptRejected("shared prefix guard: the state prefix encodes to no tokens")
    return parsed, prompts, shared_prefix(prefix_ids, prompts)


# Crafted vocabularies: merges that make guards fail ("\n"+"A", "t"+"A", ":"+"A") or that span
# the JSON punctuation a cut lands next to ("}"+",", '"}'+",", "}]"+"}", " "+'"').
MERGES = [
    (byte_symbols("\n"), "A"),
    ("t", "A"),
    (":", "A"),
    ("}", ","),
    ('"', "}"),
    ('"}', ","),
    ("}", "]"),
    ("}]", "}"),
    (byte_symbols(" "), '"'),
    (byte_symbols("\n"), byte_symbols(" ")),
    (byte_symbols(" "), byte_symbols(" ")),
    ("e", "v"),
]
# A cascade that merges "x"*24 + "y" right to left: what follows a long word reaches far back.
CASCADE = [("x", "x" * size + "y") for size in range(24)]
# "\nA" can be completed by a letter inside a tail; ">A" only across the tail's added token.
CRAFTED_ADDED = ["<|im_start|>", "<|im_end|>", "\nA", ">A"]
TOKENIZERS = ["qwen35", "smollm2", "smollm2-qwen2-split", "bytes-split", "bytes-regex"]
TOKENIZERS += ["bytes-added", "bytes"]  # whole-text BPE: both shortcuts fall back (cut, tail)


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    """SmolLM2's real tokenizer: from the converted built-in snapshot, else its GGUF."""
    from transformers import AutoTokenizer

    from semif_serve.engine import builtin

    folder, _ = builtin.snapshot(builtin.SMOLLM2, convert=False)
    if folder is not None:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    gguf = builtin.gguf_path()
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)


def _with_added(tokenizer, contents=CRAFTED_ADDED):
    tokenizer.add_special_tokens({"additional_special_tokens": contents})
    return tokenizer


def split_then_bytes(pattern: str):
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _make(name, request):
    if name == "qwen35":
        return request.getfixturevalue("qwen_tokenizer")
    if name == "smollm2":
        return request.getfixturevalue("smollm2_tokenizer")
    if name == "smollm2-qwen2-split":
        smollm2 = request.getfixturevalue("smollm2_tokenizer")
        backend = Tokenizer.from_str(smollm2.backend_tokenizer.to_str())
        backend.pre_tokenizer = split_then_bytes(QWEN2_SPLIT)
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
        tokenizer.chat_template = smollm2.chat_template
        return tokenizer
    if name == "bytes-split":  # Qwen3.5's pipeline (NFC, its Split regex) on a crafted vocabulary
        tokenizer = _with_added(byte_tokenizer(MERGES + CASCADE, normalizer=normalizers.NFC()))
        tokenizer.backend_tokenizer.pre_tokenizer = split_then_bytes(QWEN35_SPLIT)
        return tokenizer
    if name == "bytes-regex":
        tokenizer = _with_added(byte_tokenizer(MERGES))
        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(
            add_prefix_space=False, use_regex=True
        )
        return tokenizer
    if name == "bytes-added":
        return _with_added(byte_tokenizer(MERGES))
    return byte_tokenizer(MERGES)


@pytest.fixture(scope="module", params=TOKENIZERS)
def tokenizer(request):
    return _make(request.param, request)


PIECES = [
    " ", "  ", "\t", "\n", "\r\n", "\n\n", "   \n ", "}", "]", "}]}", '"}', '",', ",", ":", '"',
    "\\", "\\\\", "'s", "'RE", "0", "12", "2026-11-12", "e", "\u0301", "\u0308", "e\u0301",
    "\u00e9", "K\u00fcche", "na\u00efve", "\u1100", "\u1161", "\u11a8", "\u6f22\u5b57",
    "\U0001f600", "\U0001f44d\U0001f3fd", "\u00a0", "\u3000", "\u2028", "\x85", "\u200b", "A",
    "B", "Answer:", "assistant", "evidence", "x", "<|im_", "im_end|>", "<<|im_end|>>", "|>",
]  # fmt: skip
ENDINGS = ["", "\n", "\n\n", "assistant\n", "assistant", "Answer:", " ", "x", "<|im_start|>"]
fragments = st.one_of(
    st.sampled_from(PIECES),
    st.text(st.characters(exclude_categories=("Cs",)), max_size=4),
    st.integers(1, 300).map(lambda n: " " * n),
    st.text(" \n\t", min_size=1, max_size=40),
    st.integers(0, 5).map(lambda n: "".join(str(d % 10) for d in range(n * 7))),
)


def texts_with(added: list[str], min_size: int = 0):
    pieces = st.one_of(fragments, st.sampled_from(added)) if added else fragments
    return st.lists(pieces, min_size=min_size, max_size=14).map("".join)


def added_of(tokenizer) -> list[str]:
    return [token.content for token in tokenizer.added_tokens_decoder.values()][:8]


def rejection(call, *args):
    """What a call says: ("ok", value) or ("rejected", type, message, row_index)."""
    try:
        return ("ok", call(*args))
    except ValueError as error:
        return ("rejected", type(error), str(error), getattr(error, "row_index", None))


EXAMPLES = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@EXAMPLES
@given(data=st.data())
def test_the_tail_guard_judges_exactly_as_the_whole_prompt_guard(tokenizer, data):
    added = added_of(tokenizer)
    texts = [
        data.draw(texts_with(added))
        + data.draw(st.sampled_from(["", "x " * data.draw(st.integers(0, 400))]))
        + data.draw(st.sampled_from(ENDINGS))
        for _ in range(data.draw(st.integers(1, 3)))
    ]
    letters = [letter_token_ids(tokenizer, data.draw(st.integers(2, 16))) for _ in texts]
    ids = [encode(tokenizer, text) for text in texts]
    expected = rejection(reference_boundary, tokenizer, texts, ids, letters)
    assert rejection(check_answer_boundary, tokenizer, texts, ids, letters) == expected


@EXAMPLES
@given(data=st.data())
def test_common_text_encoded_once_gives_every_text_its_full_ids(tokenizer, data):
    common = data.draw(texts_with(added_of(tokenizer), min_size=1))
    texts = [common + data.draw(texts_with([])) for _ in range(data.draw(st.integers(1, 4)))]
    limit = data.draw(st.integers(0, len(texts[0])))
    ids, cut = encode_common(tokenizer, texts, limit)
    assert ids == [encode(tokenizer, text) for text in texts]
    if cut is not None:  # the cut's contract, for the texts that share enough of row 0
        assert cut.until <= min([limit, *(common_length(texts[0], text) for text in texts)])
        for end in {cut.until, limit, len(texts[0])}:
            head = texts[0][:end]
            assert ids[0][: cut.tokens] + encode(tokenizer, head[cut.chars :]) == encode(
                tokenizer, head
            )


STRINGS = st.one_of(texts_with([]), st.sampled_from(["", " ", "}]}", '"', "\\", "\u0301", "0"]))
STATES = st.one_of(
    STRINGS.filter(str.strip),
    st.recursive(
        st.one_of(STRINGS, st.integers(-(10**6), 10**12), st.booleans(), st.none()),
        lambda inner: st.one_of(
            st.lists(inner, min_size=1, max_size=3),
            st.dictionaries(STRINGS, inner, min_size=1, max_size=3),
        ),
        max_leaves=8,
    ).filter(lambda state: isinstance(state, (list, dict))),
    st.just({"notes": [{"date": "2026-11-12", "summary": "Resolved by a cache clear."}]}),
)


@EXAMPLES
@given(data=st.data())
def test_the_shared_encoding_equals_encoding_every_row_whole(tokenizer, data):
    state = data.draw(STATES)
    rows = [
        Row(
            id=f"r{index}",
            state=state,
            question=data.draw(STRINGS.filter(str.strip)),
            options=tuple(
                Option(f"o{k}", data.draw(STRINGS)) for k in range(data.draw(st.integers(2, 16)))
            ),
        )
        for index in range(data.draw(st.integers(1, 4)))
    ]
    lengths = [len(encode(tokenizer, render(tokenizer, row))) for row in rows]
    max_tokens = data.draw(st.sampled_from([100_000, sorted(lengths)[len(lengths) // 2]]))
    expected = rejection(reference_encode_shared, tokenizer, rows, max_tokens)
    assert rejection(encode_shared, tokenizer, rows, max_tokens) == expected


def _rows(count=3):
    from rows_factory import make_rows

    return [as_row(row) for row in make_rows(count, [2, 16, 3])]


@pytest.mark.parametrize(
    "name", ["qwen35", "smollm2", "smollm2-qwen2-split", "bytes-split", "bytes-regex"]
)
def test_the_shortcuts_are_taken_on_vouched_for_tokenizers(name, request, monkeypatch):
    tokenizer = _make(name, request)
    rows = _rows()
    texts = [render(tokenizer, row) for row in rows]
    head_end = state_head_end(rows[0], texts[0])
    ids, cut = encode_common(tokenizer, texts, head_end)
    assert ids == [encode(tokenizer, text) for text in texts]
    assert cut is not None and cut.until <= head_end
    assert head_end - cut.chars < 64, "the state is not encoded once: the cut is far before its end"
    whole: list[str] = []
    real = prompt_module.answer_boundary_failures
    monkeypatch.setattr(
        prompt_module,
        "answer_boundary_failures",
        lambda tokenizer, texts, *args: whole.extend(texts) or real(tokenizer, texts, *args),
    )
    rejection(encode_shared, tokenizer, rows, 100_000)  # bytes-regex: "\nA" fails the guard
    assert whole == [], "a whole prompt was re-encoded for the answer-boundary guard"


@pytest.mark.parametrize("name", ["bytes", "bytes-added"])
def test_whole_text_bpe_is_encoded_row_by_row(name, request):
    tokenizer = _make(name, request)
    assert cut_margin(tokenizer) is None  # its merges may span any boundary
    rows = _rows()
    texts = [render(tokenizer, row) for row in rows]
    assert encode_common(tokenizer, texts, len(texts[0])) == (encode_many(tokenizer, texts), None)


def test_tokenizers_whose_cuts_cannot_be_vouched_for_fall_back(request):
    # (tests/test_prompt.py: tokenizers whose added tokens cannot be vouched for.)
    assert cut_margin(_make("bytes-regex", request)) == 14  # "<|im_start|>" + 2
    lowered = _make("bytes-regex", request)
    lowered.backend_tokenizer.normalizer = normalizers.Lowercase()
    assert cut_margin(lowered) is None
    isolated_words = split_then_bytes(r"\s+|\S+")  # an unknown pattern
    removed = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(QWEN35_SPLIT), behavior="removed"), pre_tokenizers.ByteLevel()]
    )
    prefix_space = pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)
    unknown_splits = [isolated_words, removed, prefix_space, split_then_bytes(QWEN35_SPLIT + "|x")]
    for pre_tokenizer in unknown_splits:
        tokenizer = _make("bytes-regex", request)
        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizer
        assert cut_margin(tokenizer) is None, pre_tokenizer
    dropout = _make("bytes-regex", request)
    dropout.backend_tokenizer.model.dropout = 0.5
    assert cut_margin(dropout) is None


def test_a_cut_that_does_not_hold_for_row_0_is_not_used(qwen_tokenizer, monkeypatch):
    rows = _rows()
    texts = [render(qwen_tokenizer, row) for row in rows]
    _, offsets, _ = _offsets(qwen_tokenizer, texts[0])
    # A bogus cut inside the token 'vidence' (of "evidence"), counting that token as before it.
    chars = texts[0].index('{"evidence"') + len('{"e')
    token = next(index for index, (start, _) in enumerate(offsets) if start == chars)
    monkeypatch.setattr(shared_prompts, "find_cut", lambda *args: (chars + 1, token + 1))
    ids, cut = encode_common(qwen_tokenizer, texts, len(texts[0]))
    assert cut is None and ids == [encode(qwen_tokenizer, text) for text in texts]


def _offsets(tokenizer, text):
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return text, encoding["offset_mapping"], encoding.word_ids()


@pytest.mark.parametrize(
    ("name", "common", "ends"),
    [
        # A cut after a whitespace piece: "\n" then spaces is one piece once "\n" follows them.
        ("bytes-split", "a\n" + " " * 25, ["b", "\n"]),
        # A cut before a mark: "'s" + marks becomes "'ś" + marks when U+0301 follows (NFC).
        ("qwen35", "'s" + "\u0316" * 30, ["x", "\u0301"]),
        ("bytes-split", "'s" + "\u0316" * 30, ["x", "\u0301"]),
        # A cut inside a word: a "y" after the word merges 24 characters back into it.
        ("bytes-split", "q " + "x" * 40, ["z", "y"]),
        # A cut too close to where the texts differ.
        ("bytes-split", "q " + "x" * 40, ["y", "z"]),
    ],
)
def test_each_cut_rule_has_a_text_that_needs_it(name, common, ends, request):
    tokenizer = _make(name, request)
    texts = [common + end for end in ends]
    ids, _ = encode_common(tokenizer, texts, len(texts[0]))
    assert ids == [encode(tokenizer, text) for text in texts]


def test_common_length():
    assert common_length("abcdef", "abcxyz") == 3
    assert common_length("abc", "abcdef") == 3
    assert common_length("", "abc") == 0
    assert common_length("same", "same") == 4
