"""A teacher served by vLLM's OpenAI-compatible server, queried for the student's token ids.

``vllm serve MODEL`` (started by the user, or by ``scripts/local/serve_teacher.sh``) answers
``POST URL/v1/completions`` with ``prompt`` given as token ids (no re-tokenisation) and
``prompt_logprobs: K``: for every position ``t >= 1`` of a sequence the log-prob of token ``t``
given ``tokens[:t]`` and the model's top ``K`` there, which is exactly the scoring convention of
``engine/scoring.py`` (``x[:, t]`` belongs to token ``t``, 0 at ``t = 0`` and at padding). The
log-probs are the served model's over its whole vocabulary, at temperature 1.

One rank per student replica (its first: tensor, pipeline and context rank 0) sends that
replica's rows, ``rows_per_request`` sequences a request, ``concurrency`` requests in flight;
the other ranks of the replica receive the scores by broadcast, so the server sees each row
once (a one-token row, such as a row ``algorithm.filter`` dropped, not at all: it has no token
to score). A request that fails (connection refused or reset, timeout, HTTP 5xx) is retried
``retries`` times with doubling back-off; a reply that is not the expected JSON, or an HTTP 4xx,
is not retried. Any failure stops every rank with one :class:`TeacherServerError` naming the
URL and what went wrong, before the step's scores reach the update: the weights, the optimizer
and the checkpoints already written are untouched.

:meth:`ServedTeacher.self_test` runs at start-up: a probe sequence scored twice, in two separate
requests (replicas behind one URL must agree: SkyRL found serverless replicas that disagree by
more than the distillation signal), and against a local reference teacher when one is given.

Legend: n = rows of this rank, S = padded positions, K = top-k ids per position.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import sys
import time
import urllib.error
import urllib.request
from typing import Any, cast

import torch
import torch.distributed as dist

from megatron_gndpo.config.schema import TeacherServerConfig
from megatron_gndpo.engine.scoring import ScoreRequest, Scores
from megatron_gndpo.errors import UserError
from megatron_gndpo.parallel.groups import ParallelGroups
from megatron_gndpo.rollout.base import SamplingParams


class TeacherServerError(UserError, RuntimeError):
    """The teacher's server is unreachable, fails, or answers something else (names the URL)."""


class _Retryable(Exception):
    """A failure worth another attempt (connection, timeout, HTTP 5xx)."""


PROBE_LENGTH = 16
# A log-prob computed in float32 can round a little above 0 for a token of probability ~1; a
# reply above this is not a log-probability (another endpoint, logits, a broken server).
LOGPROB_SLACK = 1e-4


def probe_ids(vocab_size: int, length: int = PROBE_LENGTH) -> list[int]:
    """A fixed probe sequence of ``length`` ids spread over the vocabulary."""
    return [(1 + 7 * i) % vocab_size for i in range(length)]


class ServedTeacher:
    """:meth:`score_batch` of a teacher behind ``server.url``; every rank calls it
    (a :class:`~megatron_gndpo.teacher.base.Teacher`)."""

    def __init__(
        self,
        server: TeacherServerConfig,
        student_groups: ParallelGroups,
        *,
        name: str = "teacher",
    ) -> None:
        self.cfg = server
        self.url = server.url.rstrip("/")
        self.name = name
        self.student_groups = self.groups = student_groups
        layout = student_groups.layout
        replicas = layout.groups(("tp", "cp", "pp"))  # the ranks holding one replica's rows
        mine, _ = dist.new_subgroups_by_enumeration(replicas)  # collective: every rank calls it
        self._replica = cast(dist.ProcessGroup, mine)
        self._first = next(members for members in replicas if dist.get_rank() in members)[0]
        self.queries = dist.get_rank() == self._first
        self.served_model = server.served_model
        if dist.get_rank() == 0:  # before the first request, which may wait for minutes
            _say(
                f"teacher {self.name}: served at {self.url}; each request may take up to "
                f"{server.timeout_s:g} s and is retried {server.retries} time(s): a server "
                f"that does not answer stops the run after about {_minutes(server)}"
            )
        if self.queries and self.served_model is None:
            self.served_model = self._single_model()

    def rows_multiple(self) -> int:
        """1: no rows move between layouts, each replica queries for its own rows."""
        return 1

    # ------------------------------------------------------------------------------- scoring
    def score_batch(
        self,
        tokens_nS: torch.Tensor,
        lengths_n: torch.Tensor,
        request: ScoreRequest | None = None,
        images: list[torch.Tensor | None] | None = None,
    ) -> Scores:
        """:class:`Scores` ``[n, S]`` (and the top-k ``[n, S, K]`` when ``request`` asks for
        it) of this rank's rows, from the server."""
        top_k = _top_k_of(request)
        if images is not None and any(x is not None for x in images):
            raise TeacherServerError(
                f"teacher {self.name}: a served teacher scores text only; rows with images "
                "need a colocated vision-language teacher (remove teacher.server)"
            )
        n, width = tokens_nS.shape
        scores = Scores(
            torch.zeros(n, width),
            topk_ids=torch.zeros(n, width, top_k, dtype=torch.long) if top_k else None,
            topk_logprobs=torch.zeros(n, width, top_k) if top_k else None,
        )
        failure = ""
        if self.queries:
            try:
                self._fill(scores, tokens_nS.cpu(), lengths_n.cpu(), top_k)
            except TeacherServerError as err:
                failure = str(err)
        self._raise_everywhere(failure)
        for _, value in scores.items():
            dist.broadcast(value, src=self._first, group=self._replica)
        return scores.to(tokens_nS.device)

    def _fill(self, scores: Scores, tokens: torch.Tensor, lengths: torch.Tensor, k: int) -> None:
        rows = [tokens[i, : int(lengths[i])].tolist() for i in range(tokens.shape[0])]
        # A one-token row (a row algorithm.filter dropped, a pad row) has no token to score:
        # its first token's log-prob is 0 by convention, so it is not sent.
        sent = [i for i, row in enumerate(rows) if len(row) > 1]
        size = self.cfg.rows_per_request
        chunks = [sent[i : i + size] for i in range(0, len(sent), size)]
        with concurrent.futures.ThreadPoolExecutor(max_workers=self.cfg.concurrency) as pool:
            replies = pool.map(lambda chunk: self._score_rows([rows[i] for i in chunk], k), chunks)
            for chunk, reply in zip(chunks, replies, strict=True):
                for i, (logprobs, top_ids, top_logprobs) in zip(chunk, reply, strict=True):
                    self._check_reply(i, rows[i], logprobs, top_logprobs)
                    length = len(rows[i])
                    scores.logprobs[i, :length] = torch.tensor(logprobs)
                    if k:
                        assert scores.topk_ids is not None and scores.topk_logprobs is not None
                        scores.topk_ids[i, 1:length] = torch.tensor(top_ids, dtype=torch.long)
                        scores.topk_logprobs[i, 1:length] = torch.tensor(top_logprobs)

    def _check_reply(
        self, i: int, row: list[int], logprobs: list[float], top: list[list[float]]
    ) -> None:
        """Every log-prob of a reply is finite and <= 0 (within LOGPROB_SLACK); else the error
        names the teacher, the row and its first bad position."""
        values = [(t, lp) for t, lp in enumerate(logprobs)]
        values += [(t + 1, lp) for t, ranked in enumerate(top) for lp in ranked]
        for t, value in sorted(values, key=lambda tv: tv[0]):
            if not math.isfinite(value) or value > LOGPROB_SLACK:
                raise self._error(
                    f"replied a log-prob of {value} at position {t} (token {row[t]}) of row {i} "
                    f"of rank {dist.get_rank()}'s batch ({len(row)} tokens, starting "
                    f"{row[:8]}): a log-prob must be finite and <= 0. Check the server (its "
                    "logs, the model it serves; `vllm serve` returns prompt log-probs); the run "
                    "stopped before these scores reached an update"
                )

    def _score_rows(
        self, rows: list[list[int]], k: int
    ) -> list[tuple[list[float], list[list[int]], list[list[float]]]]:
        """Per row: the log-prob of each token (0.0 at t = 0) and, with ``k``, the top-k ids
        and log-probs at positions 1.. (``[length - 1, k]``)."""
        body = {
            "model": self.served_model, "prompt": rows, "max_tokens": 1, "temperature": 0.0,
            "prompt_logprobs": k, "echo": False,
        }  # fmt: skip
        reply = self._post("/v1/completions", body)
        try:
            choices = sorted(reply["choices"], key=lambda c: c["index"])
            if len(choices) != len(rows):
                raise ValueError(f"{len(choices)} choices for {len(rows)} prompts")
            return [
                _row_scores(c["prompt_logprobs"], row, k)
                for c, row in zip(choices, rows, strict=True)
            ]
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise self._error(
                f"answered /v1/completions with something other than prompt log-probs ({err}; "
                f"reply starts {json.dumps(reply)[:200]!r}). Serve the teacher with vLLM "
                "(`vllm serve MODEL`), whose completions endpoint returns prompt_logprobs"
            ) from None

    # ------------------------------------------------------------------------------- checks
    def self_test(self, vocab_size: int, reference: Any = None) -> dict[str, float]:
        """Score a probe twice (two requests) and compare; with ``reference`` (a colocated
        scorer of the same weights: its ``score_batch``) compare with it too. Every rank calls
        it; returns the measured differences."""
        ids = probe_ids(vocab_size)
        # Every rank scores the probe; a reference on another layout receives this rank's rows
        # times student DP / its own DP, so each rank sends as many copies as the reference
        # has replicas (one row would leave a larger-DP reference's replicas with none).
        rows = 1 if reference is None else reference.groups.layout.dp
        tokens = torch.tensor([ids] * rows)
        lengths = torch.tensor([len(ids)] * rows)
        first = self.score_batch(tokens, lengths).logprobs
        second = self.score_batch(tokens, lengths).logprobs
        out = {"replicas": float((first - second).abs().max())}
        if reference is not None:
            local = reference.score_batch(tokens, lengths).logprobs
            out["reference"] = float((first - local).abs().max())
        tolerance = self.cfg.check_tolerance
        problems = []
        if not bool(torch.isfinite(first).all()) or float(first.max()) > 1e-6:
            problems.append(f"log-probs that are not finite or above 0 ({first.tolist()})")
        if out["replicas"] > tolerance:
            problems.append(
                f"two scorings of one probe that differ by {out['replicas']:.3g} (more than "
                f"teacher.server.check_tolerance={tolerance:g}): replicas behind the URL that "
                "disagree; serve one model version, in one dtype, without batch-variant kernels"
            )
        if out.get("reference", 0.0) > tolerance:
            problems.append(
                f"log-probs {out['reference']:.3g} away from the local teacher (teacher.load) on "
                f"the probe (tolerance {tolerance:g}): the server serves other weights, dtype or "
                "vocabulary; check the model it was started with"
            )
        if problems:
            raise self._error("failed the start-up self-test: " + "; ".join(problems))
        return out

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, seeds: list[int], **_: Any
    ) -> list[list[int]]:
        raise TeacherServerError(
            f"teacher {self.name} is served: generating from it (TrOPD's teacher-written "
            "prefixes) is not supported; turn the prefixes off or colocate the teacher"
        )

    # ------------------------------------------------------------------------------- HTTP
    def _single_model(self) -> str:
        reply = self._get("/v1/models")
        try:
            names = [m["id"] for m in reply["data"]]
        except (KeyError, TypeError) as err:
            raise self._error(f"answered /v1/models with something else ({err})") from None
        if len(names) != 1:
            raise self._error(
                f"serves {len(names)} models ({names}); set teacher.server.served_model to one"
            )
        return str(names[0])

    def _get(self, path: str) -> Any:
        return self._with_retries(path, lambda: urllib.request.Request(self.url + path))

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        data = json.dumps(body).encode()
        return self._with_retries(
            path,
            lambda: urllib.request.Request(
                self.url + path, data=data, headers={"Content-Type": "application/json"}
            ),
        )

    def _with_retries(self, path: str, make: Any) -> Any:
        attempts, delay = self.cfg.retries + 1, 1.0
        for attempt in range(attempts):
            try:
                return self._once(path, make())
            except _Retryable as err:
                if attempt == attempts - 1:
                    raise self._error(
                        f"{path} failed {attempts} time(s), the last with {err}. Check that the "
                        "server is up and reachable from this node (curl URL/v1/models), or "
                        "raise teacher.server.timeout_s / retries"
                    ) from None
                _say(
                    f"megatron-gndpo: warning: teacher {self.name} at {self.url}{path} (asked "
                    f"by rank {dist.get_rank()}): {err}; retry {attempt + 1} of "
                    f"{self.cfg.retries} in {delay:g} s"
                )
                time.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    def _once(self, path: str, request: urllib.request.Request) -> Any:
        try:
            with urllib.request.urlopen(request, timeout=self.cfg.timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as err:
            detail = err.read()[:300].decode(errors="replace")
            if err.code >= 500:
                raise _Retryable(f"HTTP {err.code} ({detail})") from None
            raise self._error(f"refused {path}: HTTP {err.code}: {detail}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as err:
            reason = getattr(err, "reason", err)
            if isinstance(reason, TimeoutError) or "timed out" in str(reason):
                raise _Retryable(
                    f"Timeout: no answer within teacher.server.timeout_s={self.cfg.timeout_s:g} s"
                ) from None
            raise _Retryable(f"{type(reason).__name__}: {reason}") from None
        try:
            return json.loads(raw)
        except ValueError:
            raise self._error(
                f"answered {path} with something that is not JSON ({raw[:120]!r}); is URL a "
                "vLLM server?"
            ) from None

    def _error(self, what: str) -> TeacherServerError:
        return TeacherServerError(f"the server of teacher {self.name} at {self.url}: {what}")

    def _raise_everywhere(self, failure: str) -> None:
        """Every rank raises the same error when any querying rank failed (one all-reduce)."""
        flag = torch.tensor([1.0 if failure else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() == 0.0:
            return
        messages: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(messages, failure)
        raise TeacherServerError(next(m for m in messages if m))


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _minutes(server: TeacherServerConfig) -> str:
    """The longest a request waits before the run stops: every attempt timing out, with the
    doubling back-off (1 s, 2 s, ...) between them."""
    attempts = server.retries + 1
    seconds = attempts * server.timeout_s + (2**server.retries - 1)
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


def unsupported_asks(request: ScoreRequest | None) -> list[str]:
    """What ``request`` asks of a teacher beyond log-probs and the top-k (a served teacher's
    limit; also read by checks/rules.py at validation)."""
    if request is None:
        return []
    return [
        what
        for what, asked in (
            ("other ids' log-probs (extra_ids)", request.extra_ids is not None),
            ("the entropy", request.entropy),
            ("hidden states", request.hidden),
            ("a full-vocabulary KL", request.full_kl),
            ("sampled tokens", request.sample_seed is not None),
        )
        if asked
    ]


def _top_k_of(request: ScoreRequest | None) -> int:
    """The top-k a served teacher can give; anything else a method asks is refused."""
    unsupported = unsupported_asks(request)
    if unsupported:
        raise TeacherServerError(
            f"this method asks the teacher for {', '.join(unsupported)}, which a served teacher "
            "cannot give (only log-probs and the top-k); colocate the teacher"
        )
    return 0 if request is None else request.top_k


def _row_scores(
    positions: Any, row: list[int], k: int
) -> tuple[list[float], list[list[int]], list[list[float]]]:
    """One choice's ``prompt_logprobs`` (None, then one ``{token id: {logprob, rank}}`` per
    position) as the row's log-probs and top-k."""
    if not isinstance(positions, list) or len(positions) != len(row):
        raise ValueError(
            f"prompt_logprobs has {len(positions) if isinstance(positions, list) else 'no'} "
            f"positions for a prompt of {len(row)} tokens"
        )
    logprobs, top_ids, top_logprobs = [0.0], [], []
    for t in range(1, len(row)):
        entries = {int(token): value for token, value in positions[t].items()}
        if row[t] not in entries:
            raise ValueError(f"position {t} lacks its token {row[t]}")
        value = float(entries[row[t]]["logprob"])
        logprobs.append(value)  # checked by ServedTeacher._check_reply
        if k:
            ranked = sorted(
                ((int(e["rank"]), token, float(e["logprob"])) for token, e in entries.items()),
            )[:k]
            if len(ranked) < k:
                raise ValueError(f"position {t} has {len(ranked)} of the top {k}")
            top_ids.append([token for _, token, _ in ranked])
            top_logprobs.append([lp for _, _, lp in ranked])
    return logprobs, top_ids, top_logprobs
