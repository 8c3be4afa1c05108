"""Fakes for the quality tools: the production app over fake scorers in a threaded wsgiref
server on 127.0.0.1, labelled rows with known answers, and a clock only the scorer advances."""

from __future__ import annotations

import json
import threading
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from fakes import TOKEN, WAIT_S, FakeScorer, fake_app

# Option descriptions and their fake logits: the fake "reads" a description through `base`.
STRONG, WEAK, WRONG, OTHER = "clearly right", "faintly right", "wrong", "also wrong"
CONTENT = {STRONG: 3.0, WEAK: 0.5, WRONG: 0.0, OTHER: -0.5}
POSITION_A_BIAS = [1.0] + [0.0] * 15  # beats WEAK (0.5) when gold sits elsewhere


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, *args) -> None:
        pass


class ServedApp:
    """`with ServedApp(scorer, **settings) as server:` the real app on 127.0.0.1, a free port."""

    def __init__(self, scorer: FakeScorer, **overrides):
        self.app, self.scorer = fake_app(scorer, **overrides)
        self._server = make_server(
            "127.0.0.1", 0, self.app, server_class=_ThreadingServer, handler_class=_QuietHandler
        )
        self.url = f"http://127.0.0.1:{self._server.server_port}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    def __enter__(self) -> ServedApp:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._thread.join(WAIT_S)
        self._server.server_close()
        assert not self._thread.is_alive(), "the test server did not stop"


def token_file(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return path


class FakeClock:
    """Time that moves only when a fake scorer says a call took so long."""

    def __init__(self):
        self.now = 0.0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds


class TimedScorer(FakeScorer):
    """Each call advances `clock` by a chosen cost: per direct call, per shared call."""

    def __init__(self, clock: FakeClock, direct_s: float, shared_s: float, **kwargs):
        super().__init__(**kwargs)
        self.clock, self.direct_s, self.shared_s = clock, direct_s, shared_s

    def score(self, row):
        self.clock.advance(self.direct_s)
        return super().score(row)

    def score_shared(self, rows):
        self.clock.advance(self.shared_s)
        return super().score_shared(rows)


def labelled_rows(groups: int = 4, per_group: int = 3, families=("fam1", "fam2")) -> list[dict]:
    """Rows with 3 options; gold is STRONG on the first row of a group, else WEAK; gold rotates
    through positions A, B, C. Under POSITION_A_BIAS the native answer is right when gold is
    STRONG or sits at A; averaged over rotations it is always right."""
    rows = []
    for family in families:
        for group in range(groups):
            state = {"family": family, "case": group}
            for index in range(per_group):
                position = (group + index) % 3
                gold_text = STRONG if index == 0 else WEAK
                texts = [WRONG, OTHER]
                texts.insert(position, gold_text)
                rows.append(
                    {
                        "id": f"{family}-{group}-{index}",
                        "state": state,
                        "question": f"Which option fits case {group}, question {index}?",
                        "options": [
                            {"id": f"opt{k}", "description": text} for k, text in enumerate(texts)
                        ],
                        "gold": f"opt{position}",
                        "family": family,
                        "group": group,
                    }
                )
    return rows


def expected_native_correct(row: dict) -> bool:
    gold_text = next(o["description"] for o in row["options"] if o["id"] == row["gold"])
    return gold_text == STRONG or row["options"][0]["id"] == row["gold"]


def write_jsonl(path, rows) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
