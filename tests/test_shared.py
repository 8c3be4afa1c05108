"""The shared scorer equals the direct scorer row by row, on a hybrid Qwen3.5 and on SmolLM2."""

import pytest
from rows_factory import make_rows
from tiny_models import byte_symbols, byte_tokenizer

from semif_serve.scoring import PromptRejected, RowError, parse_row, score, score_shared
from semif_serve.scoring.inputs import shared_input
from semif_serve.scoring.prompt import render
from semif_serve.scoring.result import PROBABILITY_STATUS, READOUTS

RESULT_KEYS = {
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
    "cache_hit",
    "prefix_sha256",
}
TIMING_KEYS = {
    "cached_tokens",
    "reuse_point",
    "total_seconds",
    "encode_seconds",
    "prefix_tokens",
    "prefill_seconds",
    "replicate_seconds",
    "suffix_forward_seconds",
    "batch_size",
    "true_suffix_tokens",
    "padded_suffix_tokens",
    "prefix_stored",
}


def argmax(values):
    return max(range(len(values)), key=values.__getitem__)


def assert_shared_matches_direct(scoring_model, rows, tolerance):
    direct = [score(scoring_model, row, max_tokens=4096) for row in rows]
    shared, timing = score_shared(scoring_model, rows, max_tokens=4096)
    assert [result["id"] for result in shared] == [row["id"] for row in rows]
    worst = 0.0
    for one, many in zip(direct, shared):
        assert one["option_ids"] == many["option_ids"]
        assert one["prompt_sha256"] == many["prompt_sha256"]
        assert one["input_tokens"] == many["input_tokens"]
        assert argmax(one["probabilities"]) == argmax(many["probabilities"])
        worst = max(
            worst, *(abs(a - b) for a, b in zip(one["probabilities"], many["probabilities"]))
        )
    assert worst <= tolerance, f"shared vs direct max probability difference {worst}"
    return direct, shared, timing


@pytest.mark.parametrize("count", [1, 21])
@pytest.mark.parametrize("options", [[2], [16], [2, 16, 7]])
def test_shared_equals_direct_on_the_hybrid_qwen35(tiny_qwen, count, options):
    rows = make_rows(count, options)
    _, _, timing = assert_shared_matches_direct(tiny_qwen, rows, tolerance=0)
    assert timing["batch_size"] == count
    if count > 1:
        assert timing["padded_suffix_tokens"] > timing["true_suffix_tokens"], (
            "padding not exercised"
        )


@pytest.mark.slow
def test_shared_equals_direct_on_smollm2(smollm2):
    assert_shared_matches_direct(smollm2, make_rows(21, [2, 16, 3]), tolerance=1e-4)
    assert_shared_matches_direct(smollm2, make_rows(1, [16]), tolerance=1e-4)


@pytest.mark.slow
def test_a_state_ending_in_nested_punctuation_shares_its_prefix_on_smollm2(smollm2):
    # SmolLM2's vocabulary merges the `"}]}` that closes this state with the `,` after it.
    state = {"notes": [{"date": "2026-11-12", "summary": "Resolved by a cache clear."}]}
    _, _, timing = assert_shared_matches_direct(smollm2, make_rows(3, [2], state=state), 1e-4)
    assert timing["prefix_tokens"] > 60


def test_results_carry_every_upstream_key(tiny_qwen):
    rows = make_rows(3, [2, 4])
    direct = score(tiny_qwen, rows[1], max_tokens=4096)
    shared, timing = score_shared(tiny_qwen, rows, max_tokens=4096)
    assert set(direct) == RESULT_KEYS | {"cached_tokens", "reuse_point"}  # shared: in timing
    assert (direct["cached_tokens"], direct["reuse_point"]) == (0, None)
    assert set(shared[1]) == RESULT_KEYS
    assert set(timing) == TIMING_KEYS
    assert direct["prompt_version"] == "direct-options-v1"
    assert direct["probability_status"] == PROBABILITY_STATUS
    assert direct["option_ids"] == ["opt0", "opt1", "opt2", "opt3"]
    assert len(direct["probabilities"]) == len(direct["option_logits"]) == 4
    assert abs(sum(direct["probabilities"]) - 1) < 1e-9  # SemIf's own check
    assert direct["readout"] == READOUTS["direct"]
    assert shared[1]["readout"] == READOUTS["shared"]
    assert direct["summary"].endswith("over 4 option letters, one forward pass")
    assert set(direct["model"]) == {
        "source",
        "revision",
        "dtype",
        "device",
        "attention",
        "torch_version",
        "transformers_version",
    }
    assert "serving_config" not in direct["model"]
    assert shared[1]["model"]["serving_config"] == "native-state-prefix-parallel-v1"
    assert timing["prefix_tokens"] < shared[1]["input_tokens"]
    assert timing["true_suffix_tokens"] == sum(
        r["input_tokens"] - timing["prefix_tokens"] for r in shared
    )


def test_the_same_row_twice_gives_identical_scores(tiny_qwen, qwen_tokenizer):
    row = make_rows(1, [3])[0]
    first, second = (score(tiny_qwen, row, max_tokens=4096) for _ in range(2))
    timing_free = lambda result: {k: v for k, v in result.items() if not k.endswith("_seconds")}  # noqa: E731
    assert timing_free(first) == timing_free(second)
    import hashlib

    text = render(qwen_tokenizer, parse_row(row))
    assert first["prompt_sha256"] == hashlib.sha256(text.encode("utf-8")).hexdigest()


def test_shared_rows_must_share_the_exact_state(tiny_qwen):
    rows = make_rows(2, [2])
    rows[1] = {**rows[1], "state": {**rows[1]["state"], "extra": 1}}
    with pytest.raises(RowError, match=r"rows\[1\].state: differs") as caught:
        score_shared(tiny_qwen, rows, max_tokens=4096)
    assert caught.value.row_index == 1


def test_shared_rows_need_unique_ids_and_at_least_one_row(tiny_qwen):
    rows = make_rows(2, [2])
    rows[1]["id"] = rows[0]["id"]
    with pytest.raises(RowError, match=r"rows\[1\].id: duplicate id"):
        score_shared(tiny_qwen, rows, max_tokens=4096)
    with pytest.raises(ValueError, match="at least one row"):
        score_shared(tiny_qwen, [], max_tokens=4096)


def test_a_bad_shared_row_is_named_by_index(tiny_qwen):
    rows = make_rows(3, [2])
    rows[2] = {**rows[2], "question": ""}
    with pytest.raises(RowError, match=r"rows\[2\]: question") as caught:
        score_shared(tiny_qwen, rows, max_tokens=4096)
    assert caught.value.row_index == 2


def test_a_shared_row_over_max_tokens_is_named_by_index(tiny_qwen):
    rows = make_rows(3, [2])
    rows[1] = {**rows[1], "question": rows[1]["question"] + " really" * 50}
    limit = score(tiny_qwen, rows[0], max_tokens=4096)["input_tokens"] + 10
    with pytest.raises(PromptRejected, match=r"rows\[1\]: max_tokens") as caught:
        score_shared(tiny_qwen, rows, max_tokens=limit)
    assert caught.value.row_index == 1


def test_a_template_that_rewrites_the_message_has_no_shared_prefix(tiny_qwen):
    upper = byte_tokenizer(
        chat_template="{%- for m in messages %}{{ m['content'] | upper }}\n{%- endfor %}"
    )
    model = type(tiny_qwen)(model=tiny_qwen.model, tokenizer=upper, info=tiny_qwen.info)
    with pytest.raises(PromptRejected, match="shared prefix guard: the chat template changed"):
        score_shared(model, make_rows(2, [2], state="x"), max_tokens=100_000)


def test_a_prefix_whose_tokens_merge_further_back_backs_off_and_stays_exact(tiny_qwen):
    # With these merges `: "x"` ends the prefix text as [':', ' "x"'] while the full prompts hold
    # ': "x",' as one token: dropping one token is not enough (upstream raises here). The prefix
    # backs off to the tokens all prompts share, and shared still equals direct.
    quote_x = byte_symbols('"x')
    merges = [
        ('"', "x"),
        (quote_x, '"'),
        (byte_symbols(" "), quote_x + '"'),
        (byte_symbols(' "x"'), ","),
        (":", byte_symbols(' "x",')),
    ]
    tokenizer = byte_tokenizer(merges)
    model = type(tiny_qwen)(model=tiny_qwen.model, tokenizer=tokenizer, info=tiny_qwen.info)
    rows = make_rows(3, [2, 3], state="x")
    text = render(tokenizer, parse_row(rows[0]))
    naive_prefix = tokenizer.encode(text[: text.index(': "x"') + 5], add_special_tokens=False)[:-1]
    assert tokenizer.encode(text, add_special_tokens=False)[: len(naive_prefix)] != naive_prefix
    assert len(shared_input(tokenizer, [parse_row(row) for row in rows], 4096).prefix_ids) == (
        len(naive_prefix) - 1
    )
    _, _, timing = assert_shared_matches_direct(model, rows, tolerance=0)
    # The hybrid model prefills the prefix up to the start of its last 64-token chunk.
    assert timing["prefix_tokens"] == (len(naive_prefix) - 1) // 64 * 64


def test_prompts_sharing_no_leading_token_are_refused():
    from semif_serve.scoring.prompt import EncodedPrompt
    from semif_serve.scoring.shared_prompts import shared_prefix

    prompts = [EncodedPrompt("a", [1, 2, 3], [9]), EncodedPrompt("b", [4, 2, 3], [9])]
    assert shared_prefix([1, 2], [prompts[0]]) == [1, 2]
    with pytest.raises(
        PromptRejected, match="shared prefix guard: the prompts share no leading tokens"
    ):
        shared_prefix([1, 2], prompts)


@pytest.mark.parametrize("count", [1, 21])
def test_attention_only_models_share_one_prefix_copy_and_stay_exact(count):
    from tiny_models import tiny_llama

    from semif_serve.scoring import ModelInfo, ScoringModel
    from semif_serve.scoring.shared import is_pure_attention

    info = ModelInfo(source="test:tiny-llama", revision="seed-0", dtype="float32", device="cpu")
    # The stock kernels, as on CUDA: the CPU's invariant numerics never pack (test_exact_paths).
    model = ScoringModel(model=tiny_llama(), tokenizer=byte_tokenizer(), info=info, invariant=False)
    assert is_pure_attention(model.model)
    # Packed, a suffix's keys are not where its direct prompt has them: within float rounding.
    _, _, timing = assert_shared_matches_direct(model, make_rows(count, [2, 16, 5]), tolerance=1e-5)
    assert timing["replicate_seconds"] == 0.0  # nothing was copied per row
    assert timing["padded_suffix_tokens"] == timing["true_suffix_tokens"]  # nor padded


def test_hybrid_models_take_the_shared_prefix_path(tiny_qwen):
    from semif_serve.scoring.shared import is_pure_attention

    assert not is_pure_attention(tiny_qwen.model)
    _, _, timing = assert_shared_matches_direct(tiny_qwen, make_rows(3, [2]), tolerance=0)
    assert tiny_qwen.model.config._attn_implementation == "semif_invariant"  # joins the prefix


def test_a_hybrid_prefill_stops_at_a_chunk_start_and_a_shorter_prefix_runs_whole(tiny_qwen):
    """Qwen3.5's delta rule sums 64-token chunks: its shared forward prefills the prefix up to
    the start of the chunk it ends in (`prefill.prefill_length`), and with less than one chunk
    every prompt runs whole in one padded forward (nothing stored); bit-identical either way."""
    from semif_serve.scoring.prefill import linear_chunk
    from semif_serve.scoring.prefix_cache import PrefixCache

    assert linear_chunk(tiny_qwen.model.config) == 64  # its config names linear_attention layers
    long_rows = make_rows(3, [2, 3])
    _, _, timing = assert_shared_matches_direct(tiny_qwen, long_rows, tolerance=0)
    encoded = shared_input(tiny_qwen.tokenizer, [parse_row(r) for r in long_rows], 4096)
    assert timing["prefix_tokens"] == len(encoded.prefix_ids) // 64 * 64 == 64

    short = make_rows(3, [2, 3], state="x")
    prefix = len(shared_input(tiny_qwen.tokenizer, [parse_row(r) for r in short], 4096).prefix_ids)
    assert 8 < prefix < 64
    _, _, timing = assert_shared_matches_direct(tiny_qwen, short, tolerance=0)
    assert timing["prefix_tokens"] == 0
    view = PrefixCache(1 << 30, min_tokens=8).for_model(("shared", "short"))
    result = score(tiny_qwen, short[0], max_tokens=4096, prefix_cache=view)
    assert result["cache_hit"] is False and view.stats()["entries"] == 0
