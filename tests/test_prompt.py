"""The direct-options-v1 prompt and its guards, on the real Qwen3.5 vocabulary and crafted ones."""

import hashlib
import json

import pytest
from tiny_models import PLAIN_CHAT_TEMPLATE, byte_symbols, byte_tokenizer
from tokenizers import normalizers

from semif_serve.scoring import PromptRejected, parse_row, score
from semif_serve.scoring.prompt import SYSTEM_PROMPT, encode_prompt, messages, render

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
