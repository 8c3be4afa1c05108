"""The direct-options-v1 prompt and its guards, on the real Qwen3.5 vocabulary and crafted ones."""

import hashlib
import json

import pytest
from tiny_models import PLAIN_CHAT_TEMPLATE, byte_symbols, byte_tokenizer
from tokenizers import AddedToken, normalizers, pre_tokenizers

from semif_serve.scoring import PromptRejected, parse_row, score
from semif_serve.scoring import prompt as prompt_module
from semif_serve.scoring.added_tokens import AddedTokens, added_tokens, tail_start
from semif_serve.scoring.prompt import (
    SYSTEM_PROMPT,
    check_answer_boundary,
    encode,
    encode_prompt,
    letter_token_ids,
    messages,
    render,
)

ROW = parse_row(
    {
        "id": "door",
        "state": {"room": "Küche", "door": "open"},
        "question": "Is the door open?",
        "options": [{"id": "yes", "description": "Yes, open"}, {"id": "no", "description": "No"}],
    }
)


def test_the_two_messages_match_upstream():
    system, user = messages(ROW)
    assert system == {"role": "system", "content": SYSTEM_PROMPT}
    assert SYSTEM_PROMPT == (
        "Apply the supplied criterion to the supplied evidence. Choose exactly one listed option. "
        "Respond with only its uppercase letter, with no explanation or reasoning."
    )
    assert user["role"] == "user"
    assert user["content"] == (
        '{"evidence": {"room": "Küche", "door": "open"}, "criterion": "Is the door open?", '
        '"options": [{"letter": "A", "description": "Yes, open"}, {"letter": "B", "description": "No"}]}'
    )
    assert json.loads(user["content"])["options"][1] == {"letter": "B", "description": "No"}


def test_rendering_disables_thinking(qwen_tokenizer):
    text = render(qwen_tokenizer, ROW)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert text.startswith("<|im_start|>system\n" + SYSTEM_PROMPT + "<|im_end|>\n")


def test_the_real_qwen_vocabulary_passes_every_guard(qwen_tokenizer):
    prompt = encode_prompt(qwen_tokenizer, ROW, max_tokens=4096)
    assert prompt.ids == qwen_tokenizer.encode(prompt.text, add_special_tokens=False)
    assert [qwen_tokenizer.decode([token]) for token in prompt.letter_token_ids] == ["A", "B"]
    assert prompt.sha256 == hashlib.sha256(prompt.text.encode("utf-8")).hexdigest()


def test_a_letter_that_is_not_one_token_is_rejected():
    # With a prefix space, "A" becomes "ĠA", which this vocabulary splits into two tokens.
    with pytest.raises(PromptRejected, match=r"letter guard: 'A' encodes to 2 tokens"):
        encode_prompt(byte_tokenizer(add_prefix_space=True), ROW, max_tokens=4096)


def test_letters_sharing_a_token_are_rejected():
    tokenizer = byte_tokenizer(normalizer=normalizers.Replace("B", "A"))
    with pytest.raises(PromptRejected, match="letter guard: letters share a token"):
        encode_prompt(tokenizer, ROW, max_tokens=4096)


def test_a_letter_that_does_not_decode_to_itself_is_rejected():
    class Lowercasing:
        """Decodes every token to lowercase, so 'A' comes back as 'a'."""

        def __init__(self):
            self.inner = byte_tokenizer()

        def apply_chat_template(self, conversation, **kwargs):
            return self.inner.apply_chat_template(conversation, **kwargs)

        def encode(self, text, add_special_tokens=False):
            return self.inner.encode(text, add_special_tokens=add_special_tokens)

        def decode(self, ids):
            return self.inner.decode(ids).lower()

    with pytest.raises(
        PromptRejected, match="letter guard: 'A' encodes to token .* decodes to 'a'"
    ):
        encode_prompt(Lowercasing(), ROW, max_tokens=4096)


def test_an_answer_letter_that_merges_into_the_prompt_is_rejected():
    # The plain template ends with "assistant\n"; this vocabulary merges "\n" + "B" into one token.
    tokenizer = byte_tokenizer([(byte_symbols("\n"), "B")])
    with pytest.raises(PromptRejected, match="answer boundary guard: prompt \\+ 'B'"):
        encode_prompt(tokenizer, ROW, max_tokens=4096)


def test_a_prompt_over_max_tokens_is_rejected_not_truncated(qwen_tokenizer):
    length = len(encode_prompt(qwen_tokenizer, ROW, max_tokens=4096).ids)
    assert len(encode_prompt(qwen_tokenizer, ROW, max_tokens=length).ids) == length
    with pytest.raises(
        PromptRejected,
        match=f"max_tokens: the prompt has {length} tokens, over the limit of {length - 1}",
    ):
        encode_prompt(qwen_tokenizer, ROW, max_tokens=length - 1)


def test_the_scorer_rejects_before_any_forward(tiny_qwen):
    row = {**ROW.__dict__, "options": [{"id": "a", "description": "A"}]}
    with pytest.raises(ValueError, match="options: must hold 2..16 items"):
        score(tiny_qwen, row, max_tokens=4096)


def test_the_plain_template_is_used_verbatim():
    tokenizer = byte_tokenizer(chat_template=PLAIN_CHAT_TEMPLATE)
    text = render(tokenizer, ROW)
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")


# The answer-boundary guard's tail shortcut (tests/test_prompt_fastpath.py checks it against the
# whole-prompt guard on generated prompts; these pin the cases it must hand to that guard).


def with_added(tokenizer, contents):
    tokenizer.add_special_tokens({"additional_special_tokens": contents})
    return tokenizer


def regex_bytes():
    """Byte-level BPE behind GPT-2's regex, with "\\nA" as an added token and a "t"+"A" merge."""
    tokenizer = with_added(byte_tokenizer([("t", "A")]), ["<|im_start|>", "<|im_end|>", "\nA"])
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(
        add_prefix_space=False, use_regex=True
    )
    return tokenizer


def test_tail_guard_failures_are_named_like_the_whole_prompt_guard():
    tokenizer = regex_bytes()
    texts = ["<|im_end|>x", "<|im_start|>assistant\n", "<|im_start|>assistant"]
    ids = [encode(tokenizer, text) for text in texts]
    letters = [letter_token_ids(tokenizer, 2)] * 3
    with pytest.raises(PromptRejected, match=r"answer boundary guard: prompt \+ 'A'") as caught:
        check_answer_boundary(tokenizer, texts, ids, letters)
    assert caught.value.row_index == 1  # "\nA" is an added token: the letter joins it
    with pytest.raises(PromptRejected, match=r"prompt \+ 'A'") as caught:
        check_answer_boundary(tokenizer, texts[2:], ids[2:], letters[2:])
    assert caught.value.row_index == 0  # "t"+"A" merge within the pre-token "assistantA"
    check_answer_boundary(tokenizer, texts[:1], ids[:1], letters[:1])


def test_a_letter_completing_an_added_token_begun_before_the_tail_is_judged_whole():
    tokenizer = with_added(byte_tokenizer(), ["<x>", "q<x>A"])
    texts = ["q<x>"]  # + "A": the longer token, starting first, takes the letter in
    ids, letters = [encode(tokenizer, texts[0])], [letter_token_ids(tokenizer, 2)]
    with pytest.raises(PromptRejected, match=r"prompt \+ 'A'") as caught:
        check_answer_boundary(tokenizer, texts, ids, letters)
    assert caught.value.row_index == 0


def test_a_tail_not_encoded_as_in_the_prompt_is_judged_whole(monkeypatch):
    # Metaspace "first" marks only the text's first piece, so the tail alone encodes as "▁x"
    # (one token here) while the prompt holds "x", and "▁x" + "A" hides the "x"+"A" merge.
    meta = byte_symbols("\u2581")
    merges = [(meta[0], meta[1]), (meta[:2], meta[2]), (meta, "x"), ("x", "A")]
    tokenizer = with_added(byte_tokenizer(merges), ["<|im_start|>"])
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Metaspace(prepend_scheme="first", split=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    assert added_tokens(tokenizer) is None  # why such tokenizers are never vouched for
    monkeypatch.setattr(prompt_module, "added_tokens", lambda _: AddedTokens(("<|im_start|>",)))
    texts = ["<|im_start|>x"]
    ids, letters = [encode(tokenizer, texts[0])], [tokenizer.convert_tokens_to_ids(["A", "B"])]
    assert encode(tokenizer, "x") != ids[0][-1:]
    with pytest.raises(PromptRejected, match=r"prompt \+ 'A'"):
        check_answer_boundary(tokenizer, texts, ids, letters)


def test_overlapping_added_tokens_have_no_tail():
    added = added_tokens(with_added(byte_tokenizer(), ["<a>", "a>b", "<x>"]))
    assert tail_start("q<x>r<a>bc", added) is None  # "<a>" and "a>b" overlap
    assert tail_start("q<a>r<x>bc", added) == 8
    assert tail_start("<x>" + "y" * 3000, added) == 3  # beyond the window searched first
    assert tail_start("no added token", added) is None


def test_added_tokens_that_cannot_be_vouched_for():
    class NoBackend:
        pass

    assert added_tokens(NoBackend()) is None
    assert added_tokens(byte_tokenizer()).contents == ()
    for flag in ("lstrip", "rstrip", "single_word"):
        flagged = byte_tokenizer()
        flagged.add_special_tokens(
            {"additional_special_tokens": [AddedToken("<s>", **{flag: True})]}
        )
        assert added_tokens(flagged) is None, flag
    normalized = byte_tokenizer(normalizer=normalizers.NFC())
    normalized.add_tokens([AddedToken("<n>", normalized=True)])
    assert added_tokens(normalized) is None
    assert added_tokens(with_added(byte_tokenizer(), ["<n>"])).contents == ("<n>",)
    split = regex_bytes()
    split.split_special_tokens = True
    assert added_tokens(split) is None
