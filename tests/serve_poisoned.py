"""A real gunicorn semif-serve whose model's weights hold 4 KB of 0xFF (tests/test_startup_checks.py).

The production app and engine (semif_serve/engine/boot.py build_engine: load, warm-up, baseline) over the
tiny random Llama and the byte tokenizer, as loaded from a folder whose weights a disk error or a
bad copy overwrote. `poisoned` is also what the in-process tests load.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import byte_tokenizer, tiny_llama  # noqa: E402

from semif_serve.scoring import ModelInfo, ScoringModel  # noqa: E402

POISON = b"\xff" * 4096  # float32 0xFFFFFFFF is a NaN


def poisoned(source: str, token_ids: list[int] | None = None) -> ScoringModel:
    """The tiny model with POISON over the start of its input embeddings (every prompt meets
    them: the first rows are the bytes of ASCII punctuation), or over the rows of `token_ids`
    only (a prompt without those tokens scores as before)."""
    model, tokenizer = tiny_llama(), byte_tokenizer()
    weight = model.get_input_embeddings().weight
    with torch.no_grad():
        if token_ids is None:
            weight.view(-1).view(torch.uint8)[: len(POISON)] = torch.frombuffer(
                bytearray(POISON), dtype=torch.uint8
            )
        else:
            weight[token_ids] = float("nan")
    info = ModelInfo(source=source, revision="poisoned", dtype="float32", device="cpu")
    return ScoringModel(model=model, tokenizer=tokenizer, info=info)


if __name__ == "__main__":
    from semif_serve.config import Settings
    from semif_serve.engine.boot import build_engine
    from semif_serve.server import run

    settings = Settings.from_env()
    run(
        settings,
        engine_factory=lambda spec: build_engine(
            settings, spec, load=lambda source, *args, **kwargs: poisoned(source)
        ),
    )
