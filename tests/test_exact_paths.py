"""Issues 30 and 44, "exact on every path": whichever path scores a row, it gets the bits the
direct scorer gives it alone, in float32 and in bfloat16 (`scoring.invariant`), so a result
never depends on who else was queued or on a cache hit; the head reproduces the model's own
post-processing (Cohere's `logit_scale`, Granite's `logits_scaling`, Gemma2's
`final_logit_softcapping`), and a model whose forward post-processes its logits in a way the
scorers do not reproduce is refused when it is wrapped.

The reference is the direct scorer on one row (`scoring.score`, no cache). The paths:
- `batched-padded`: plain rows of different lengths in one right-padded forward (`score_batch`);
- `batched-over-state`: rows over one state in one batch, sharing one prefill (`score_batch`);
- `shared`: a `/decide/shared` call (`score_shared`): packed for attention-only models, the
  prefix replicated per row for the others (Qwen3.5's linear attention, Gemma2's windows);
- `packed`: `packed.forward_packed` itself (attention-only models, the only ones it serves);
- `cached-hit`: the direct scorer resuming a stored prefill of the row's state prefix;
- `batched-over-template`: distinct requests (direct rows and one-row shared calls) in one
  forward over the model's kept template prefix (`scoring.template`);
- `among-15-strangers`: plain rows, the checked ones first and last of 16 of other lengths;
- `grown-state`: rows over a state that grew by two events, resuming the stored prefill of its
  earlier version.
Tiny random models on the CPU, in both dtypes: bit-identical logits and probabilities, but for
one exception at a tolerance: `packed` (one row holds every suffix, so a suffix's keys are not
where its direct prompt has them) is what CUDA models run; the CPU's invariant numerics use the
prefix-joining attention instead, so it is checked in float32 within 1e-5. Qwen3.5's linear
attention layers (transformers' chunked delta rule, causal conv1d) are bit-identical on every
path: the invariant numerics compute their softplus, sigmoid and silu over whole vectors, and
its prefills stop only at the start of one of the rule's 64-token chunks
(`prefill.prefill_length`), where a continuation sums each chunk as one pass does; its 40-token
template ends inside the first chunk, so over the template its rows run whole. Then the head
itself against the whole model for every class it accepts, and the refusal of any other.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch
from rows_factory import STATE, make_rows
from tiny_models import (
    byte_tokenizer,
    tiny_causal_lm,
    tiny_cohere,
    tiny_falcon_h1,
    tiny_gemma2,
    tiny_granite,
    tiny_llama,
    tiny_qwen35,
)
from transformers import LlamaForCausalLM

from semif_serve.engine.loading import ModelLoadError, load_model
from semif_serve.scoring import (
    ModelInfo,
    ScoringModel,
    invariant,
    parse_row,
    score,
    score_shared,
)
from semif_serve.scoring.coalesced import score_batch
from semif_serve.scoring.head import (
    POST_PROCESSING,
    UnsupportedModel,
    check_supported,
    letter_logits,
)
from semif_serve.scoring.inputs import direct_input, shared_input
from semif_serve.scoring.packed import forward_packed
from semif_serve.scoring.prefix_cache import PrefixCache
from semif_serve.scoring.result import letter_probabilities
from semif_serve.scoring.shared import is_pure_attention
from semif_serve.scoring.template import TemplatePrefix

TOLERANCE = 1e-5
MAX_TOKENS = 4096
INFO = ModelInfo(source="test:exact-paths", revision="seed-0", dtype="float32", device="cpu")
DTYPES = ["float32", "bfloat16"]

# Byte-tokenizer models; "qwen3.5" is conftest's tiny hybrid Qwen3.5 on its real tokenizer.
BYTE_MODELS = {
    "llama": tiny_llama,
    "cohere": tiny_cohere,
    "granite": tiny_granite,
    "gemma2": tiny_gemma2,
}
MODELS = ["llama", "qwen3.5", "cohere", "granite", "gemma2"]


def state(number: int, words: int = 0) -> dict:
    return {**STATE, "ticket": f"Ticket {number}: {STATE['ticket']}" + " more" * words}


def rows_over(one_state: dict, count: int, prefix: str) -> list:
    """`count` rows over `one_state` with 2..4 options and questions of their own lengths."""
    return [parse_row(row) for row in make_rows(count, [2, 3, 4], state=one_state, prefix=prefix)]


def batched_padded(model: ScoringModel) -> list:
    """Plain rows over states of different lengths: one right-padded forward."""
    rows = [rows_over(state(index, 5 * index), 1, f"plain{index}")[0] for index in range(3)]
    inputs = [direct_input(model.tokenizer, row, MAX_TOKENS, with_prefix=False) for row in rows]
    assert len({len(item.prompt.ids) for item in inputs}) == 3  # real padding
    outcomes = score_batch(model, inputs, max_tokens=MAX_TOKENS)
    assert [outcome.rows for outcome in outcomes] == [3, 3, 3]
    return [(row, outcome.outcome) for row, outcome in zip(rows, outcomes)]


def batched_over_state(model: ScoringModel) -> list:
    """Rows over one state in one batch, no cache: one prefill, then their suffixes."""
    rows = rows_over(state(7, 3), 3, "same")
    inputs = [direct_input(model.tokenizer, row, MAX_TOKENS, with_prefix=True) for row in rows]
    outcomes = score_batch(model, inputs, max_tokens=MAX_TOKENS)
    assert [outcome.rows for outcome in outcomes] == [3, 3, 3]
    return [(row, outcome.outcome) for row, outcome in zip(rows, outcomes)]


def shared(model: ScoringModel) -> list:
    rows = rows_over(state(8, 2), 3, "shared")
    results, _ = score_shared(model, rows, max_tokens=MAX_TOKENS)
    return list(zip(rows, results))


def packed(model: ScoringModel) -> list:
    """`forward_packed` on the stock kernels, as CUDA runs it (`scoring_model`)."""
    rows = rows_over(state(9, 4), 3, "packed")
    encoded = shared_input(model.tokenizer, rows, MAX_TOKENS)
    logits, _ = forward_packed(model.model, encoded.prefix_ids, encoded.prompts, None, None)
    return [
        (row, {"option_logits": row_logits.tolist(), "probabilities": _probabilities(row_logits)})
        for row, row_logits in zip(rows, logits)
    ]


def cached_hit(model: ScoringModel) -> list:
    """One row stores its state prefix; the next rows over that state resume it."""
    cache = PrefixCache(1 << 30, min_tokens=16).for_model(("exact-paths", id(model)))
    stored, *rows = rows_over(state(10, 6), 3, "cached")
    score(model, stored, max_tokens=MAX_TOKENS, prefix_cache=cache)
    results = [score(model, row, max_tokens=MAX_TOKENS, prefix_cache=cache) for row in rows]
    assert [result["cache_hit"] for result in results] == [True, True]
    return list(zip(rows, results))


def batched_over_template(model: ScoringModel) -> list:
    """Requests over distinct states of different lengths, direct rows and one-row shared calls
    mixed, in one forward over the model's template prefix: its prefill kept by the first
    batch, resumed by the second (whose results are checked)."""
    template = TemplatePrefix.of(model.tokenizer, MAX_TOKENS)
    assert template is not None
    rows = [rows_over(state(20 + index, 3 * index), 1, f"tpl{index}")[0] for index in range(4)]
    inputs = [
        direct_input(model.tokenizer, row, MAX_TOKENS, with_prefix=True)
        if index % 2
        else shared_input(model.tokenizer, [row], MAX_TOKENS)
        for index, row in enumerate(rows)
    ]
    for _ in range(2):
        outcomes = score_batch(model, inputs, max_tokens=MAX_TOKENS, template=template)
    assert [outcome.rows for outcome in outcomes] == [4] * 4
    sliding = type(model.model).__name__ == "Gemma2ForCausalLM"  # never kept, as no prefix is
    # Qwen3.5's template (40 tokens) ends inside the delta rule's first 64-token chunk: its
    # prefill stops at 0 (`prefill.prefill_length`), and the rows run whole in that one forward.
    hybrid = not is_pure_attention(model.model) and not sliding
    assert (template.held_bytes() > 0) is not (sliding or hybrid)
    results = [
        outcome.outcome[0][0] if index % 2 == 0 else outcome.outcome
        for index, outcome in enumerate(outcomes)
    ]
    return list(zip(rows, results))


def among_strangers(model: ScoringModel) -> list:
    """16 plain rows over states of 16 lengths in one padded forward; the first and last checked."""
    rows = [rows_over(state(40 + index, index), 1, f"crowd{index}")[0] for index in range(16)]
    inputs = [direct_input(model.tokenizer, row, MAX_TOKENS, with_prefix=False) for row in rows]
    outcomes = score_batch(model, inputs, max_tokens=MAX_TOKENS)
    assert [outcome.rows for outcome in outcomes] == [16] * 16
    return [(rows[index], outcomes[index].outcome) for index in (0, 15)]


def grown_state(model: ScoringModel) -> list:
    """A state that grew by two events: its rows resume the earlier version's stored prefill."""
    view = PrefixCache(1 << 30, min_tokens=16, checkpoint_tokens=32).for_model(("grown", id(model)))
    events = [f"[{n:02d}] the printer on floor {n} jammed during job {n * 7}" for n in range(6)]
    score_shared(model, rows_over({"log": "\n".join(events[:4])}, 1, "g"), max_tokens=MAX_TOKENS,
                 prefix_cache=view)  # fmt: skip
    rows = rows_over({"log": "\n".join(events)}, 2, "grown")
    results, timing = score_shared(model, rows, max_tokens=MAX_TOKENS, prefix_cache=view)
    assert timing["cached_tokens"] > 0 or type(model.model).__name__ == "Gemma2ForCausalLM"
    return list(zip(rows, results))


def _probabilities(letter_logits: torch.Tensor) -> list[float]:
    return letter_probabilities(letter_logits).tolist()


PATHS = {
    "batched-padded": batched_padded,
    "batched-over-state": batched_over_state,
    "shared": shared,
    "packed": packed,
    "cached-hit": cached_hit,
    "batched-over-template": batched_over_template,
    "among-15-strangers": among_strangers,
    "grown-state": grown_state,
}
# Paths a model never takes: packing needs attention-only layers (Qwen3.5 has linear attention,
# Gemma2 sliding windows), and a prefill is stored only when its cache can be shared
# (Gemma2's sliding-window layers cannot: its rows always prefill).
NOT_TAKEN = {("qwen3.5", "packed"), ("gemma2", "packed"), ("gemma2", "cached-hit")}
CASES = [
    pytest.param(name, path, dtype, id=f"{name}-{path}-{dtype}")
    for name in MODELS
    for path in PATHS
    for dtype in DTYPES
    if (name, path) not in NOT_TAKEN and (path, dtype) != ("packed", "bfloat16")
]


def _tolerance(model_name: str, path: str, dtype: str) -> float:
    """0 (bit-identical) but for the exceptions the module docstring names."""
    return TOLERANCE if path == "packed" else 0.0


@pytest.fixture(scope="module")
def byte_models() -> dict[tuple[str, str], ScoringModel]:
    """Per (name, dtype); (name, "stock"): float32 on the stock kernels, what `packed` runs on."""
    tokenizer = byte_tokenizer()
    models = {
        (name, dtype): ScoringModel(build().to(getattr(torch, dtype)), tokenizer, INFO)
        for name, build in BYTE_MODELS.items()
        for dtype in DTYPES
    }
    stock = {(name, "stock"): ScoringModel(build(), tokenizer, INFO, invariant=False)
             for name, build in BYTE_MODELS.items()}  # fmt: skip
    return models | stock


@pytest.fixture(scope="module")
def qwen_bfloat16(qwen_tokenizer) -> ScoringModel:
    return ScoringModel(tiny_qwen35().to(torch.bfloat16), qwen_tokenizer, INFO)


@pytest.fixture
def scoring_model(request, byte_models, model_name, path, dtype) -> ScoringModel:
    if model_name == "qwen3.5":
        return request.getfixturevalue("tiny_qwen" if dtype == "float32" else "qwen_bfloat16")
    return byte_models[(model_name, "stock" if path == "packed" else dtype)]


@pytest.mark.parametrize(("model_name", "path", "dtype"), CASES)
def test_every_path_gives_a_row_the_bits_it_gets_alone(scoring_model, model_name, path, dtype):
    assert scoring_model.model.dtype == getattr(torch, dtype)
    assert invariant.installed(scoring_model.model) is (path != "packed")
    tolerance = _tolerance(model_name, path, dtype)
    for row, result in PATHS[path](scoring_model):
        alone = score(scoring_model, row, max_tokens=MAX_TOKENS)
        if tolerance == 0.0:
            assert result["option_logits"] == alone["option_logits"]
            assert result["probabilities"] == alone["probabilities"]
            continue
        assert result["option_logits"] == pytest.approx(alone["option_logits"], abs=tolerance)
        assert result["probabilities"] == pytest.approx(alone["probabilities"], abs=tolerance)


def test_the_paths_a_model_never_takes_are_the_ones_left_out(byte_models, tiny_qwen):
    """NOT_TAKEN is what the scorers do, not a convenience: packing is for attention-only models,
    and the prefix cache stores no Gemma2 prefill."""
    models = {name: byte_models[(name, "float32")] for name in BYTE_MODELS} | {"qwen3.5": tiny_qwen}
    packable = {name for name, model in models.items() if is_pure_attention(model.model)}
    assert packable == {"llama", "cohere", "granite"}
    cache = PrefixCache(1 << 30, min_tokens=16).for_model(("exact-paths", "gemma2"))
    stored, row = rows_over(state(11, 6), 2, "uncached")
    for item in (stored, row):
        result = score(models["gemma2"], item, max_tokens=MAX_TOKENS, prefix_cache=cache)
    assert not result["cache_hit"] and cache.stats()["entries"] == 0


# The accepted classes whose forward changes the logits after `lm_head`.
POST_PROCESSED = {
    "CohereForCausalLM",
    "GraniteForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
}


@pytest.mark.parametrize("class_name", list(POST_PROCESSING))
def test_the_head_gives_every_accepted_class_what_its_whole_forward_gives(class_name):
    """For each class the scorers accept (each has a tiny model in TINY_EXTRAS): letter logits
    read from the decoder's hidden states through `head.letter_logits` equal the whole model's,
    two rows at once; and for the post-processing classes the bare `lm_head` would not."""
    model = tiny_causal_lm(class_name)
    input_ids = torch.randint(3, 300, (2, 80), generator=torch.Generator().manual_seed(1))
    prompts = [
        SimpleNamespace(letter_token_ids=[65, 66, 67]),
        SimpleNamespace(letter_token_ids=[7, 299]),
    ]
    with torch.inference_mode():
        whole = model(input_ids=input_ids).logits[:, -1]
        hidden = model.get_decoder()(input_ids=input_ids).last_hidden_state[:, -1]
        letters = letter_logits(model, hidden, prompts)
        bare = model.get_output_embeddings()(hidden)
    for row, prompt in enumerate(prompts):
        expected = whole[row, prompt.letter_token_ids]
        assert letters[row].tolist() == pytest.approx(expected.tolist(), abs=TOLERANCE)
    changed = not torch.allclose(bare, whole, rtol=0, atol=TOLERANCE)
    assert changed == (class_name in POST_PROCESSED)


class ScaledLlama(LlamaForCausalLM):
    """A subclass free to post-process its logits in its own forward."""


@pytest.mark.parametrize(
    ("build", "named"),
    [
        pytest.param(lambda: ScaledLlama(tiny_llama().config), r"\.ScaledLlama ", id="subclass"),
        pytest.param(lambda: torch.nn.Linear(2, 2), r"torch\.nn\..*\.Linear ", id="not-an-lm"),
    ],
)
def test_a_model_of_any_other_class_is_refused_when_it_is_wrapped(build, named):
    with pytest.raises(UnsupportedModel, match=named + r"is not supported") as refused:
        ScoringModel(build(), byte_tokenizer(), INFO)
    assert "CohereForCausalLM" in str(refused.value)  # what is supported, named


class Gemma3ForCausalLM:
    """A supported class's name, from a transformers that has no such class."""


def test_a_supported_name_that_transformers_lacks_is_refused_naming_what_is_supported(
    monkeypatch,
):
    monkeypatch.setitem(sys.modules, "transformers", SimpleNamespace())  # an older transformers
    with pytest.raises(UnsupportedModel) as refused:
        check_supported(Gemma3ForCausalLM())
    assert str(refused.value) == (
        f"{Gemma3ForCausalLM.__module__}.Gemma3ForCausalLM is not supported: semif-serve "
        "reproduces the final logits (logit scaling, soft-capping) of these transformers "
        f"classes only: {', '.join(POST_PROCESSING)}; this class's forward may change its "
        "logits in a way that its batched, shared and cached scoring would not reproduce"
    )


def test_a_refused_class_is_refused_when_it_is_loaded(tmp_path):
    """From a model folder, as the server loads one: FalconH1 scales its logits by its own
    `lm_head_multiplier`, which the scorers do not reproduce. A load error (503 on a PUT, a
    failed start, `semif-serve score`'s own message), naming the folder and the class."""
    tiny_falcon_h1().save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match=r"\.FalconH1ForCausalLM is not supported") as caught:
        load_model(str(tmp_path))
    assert str(caught.value).startswith(f"{tmp_path}: ")
