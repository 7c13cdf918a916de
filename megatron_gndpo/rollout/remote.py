"""Rollouts sampled on rollout ranks apart from the trainer (``rollout.disaggregate``).

Two sides of one pipeline, joined by the bridge of :mod:`megatron_gndpo.parallel.bridge`:

- :class:`RolloutWorker` runs on the rollout ranks: a copy of the student (its own tensor
  parallelism, on the rollout ranks' own megatron state) with the built-in generator, or a
  vLLM engine per rollout replica (``rollout.engine=vllm``). It obeys the
  trainer's rank 0 in order: ``weights`` (receive and load version ``v``), ``batch`` (sample every
  block requested for batch ``j``, each with the weights it holds), ``stop``.
- :class:`RemoteRollouts` is the trainer's side: :meth:`~RemoteRollouts.publish` sends the
  student's weights after an update (Hugging Face names, as the colocated sync; flat buckets of
  whole layers, broadcast from the trainer's rank 0 without waiting for the rollout ranks),
  :meth:`~RemoteRollouts.request` asks for a batch, :meth:`~RemoteRollouts.take` receives it.

Each trainer data-parallel replica ``d`` has its rows sampled by rollout replica
``d mod replicas``, one request per replica and batch, generated as its own batch: the rows, the
seeds and the batch composition are the colocated run's, so at staleness 0 (and the same tensor
parallelism) the tokens are the colocated run's bit for bit.

Which weights sample which batch is decided by the order of the commands alone (the trainer's
schedule: :mod:`megatron_gndpo.rollout.pipeline`): the trainer publishes ``W_k`` after step
``k`` and then requests batch ``k + 1 + staleness``, so that batch is sampled with ``W_k`` and
never sooner (the rollout ranks wait for the weights: nothing is ever dropped). Every result
carries the version it was sampled with; :meth:`~RemoteRollouts.take` checks it, and compares
the rollout copy's log-probs of a probe sequence with the trainer's
(``rollout.weight_sync_check``), as the colocated sync's check does.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from megatron_gndpo.config import Config
from megatron_gndpo.config.schema import ModelConfig
from megatron_gndpo.parallel.bridge import Bridge, Placement, bridge
from megatron_gndpo.parallel.groups import ParallelGroups, ParallelLayout
from megatron_gndpo.rollout.base import Rollout, SamplingParams
from megatron_gndpo.weight_sync.buckets import bucketed
from megatron_gndpo.weight_sync.check import (
    WeightSyncError,
    check_due,
    probe_difference,
    probe_tokens,
    tolerance_of,
)
from megatron_gndpo.weight_sync.sync import DEFAULT_BUCKET_BYTES

# The student's log-probs of the weight-sync probe (``engine/probe.py``'s ``model_probe``): a
# scoring pass, which the entry points hand in (rollout/ runs no scoring of its own).
ModelProbe = Callable[..., torch.Tensor]

INFLIGHT_DIR = "inflight"  # in a checkpoint's step directory: the batches sampled ahead


@dataclasses.dataclass
class Request:
    """One trainer replica's rows of one batch."""

    batch: int
    replica: int  # the trainer's data-parallel replica
    ids: list[list[int]]
    seeds: list[int]
    params: SamplingParams


@dataclasses.dataclass
class Result:
    """A request's rollout and what it was sampled with."""

    batch: int
    replica: int
    rollout: Rollout
    version: int  # the trainer step after which the sampling weights were published
    seconds: float  # generation time on the rollout ranks
    probe: torch.Tensor | None = None  # the rollout copy's probe log-probs of ``version``


@dataclasses.dataclass(frozen=True)
class _Tensor:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int


def trainer_layout(cfg: Config, trainer_ranks: int) -> ParallelLayout:
    from megatron_gndpo.parallel.groups import layout_of

    return layout_of(cfg.parallel, trainer_ranks)


def _leader(layout: ParallelLayout, replica: int) -> int:
    return layout.rank_of({"tp": 0, "cp": 0, "dp": replica, "pp": 0})


def placement_of(cfg: Config, b: Bridge) -> Placement:
    """The job's placement with the rollout ranks' layout (the bridge knows the split only)."""
    d = cfg.rollout.disaggregate
    if d.ranks != b.placement.rollout_ranks:
        raise RuntimeError(
            f"the job was started with {b.placement.rollout_ranks} rollout rank(s) but "
            f"rollout.disaggregate.ranks is {d.ranks}: start it from the same config"
        )
    return Placement(b.placement.world_size, d.ranks, d.tensor_parallel)


# ---------------------------------------------------------------------------------------------
# The trainer's side


class RemoteRollouts:
    """The trainer's end of the pipeline; every trainer rank holds one and calls every method
    in the same order (:meth:`publish` and :meth:`take` run collectives over the trainer)."""

    def __init__(
        self, cfg: Config, student: Any, groups: ParallelGroups, *, probe: ModelProbe
    ) -> None:
        b = bridge()
        assert b is not None, "rollout.disaggregate needs init_distributed(rollout_ranks=...)"
        self.bridge: Bridge = b
        self.cfg, self.student, self.groups = cfg, student, groups
        self.model_probe = probe
        p = placement_of(cfg, b)
        self.rollout_ranks = list(range(p.trainer_ranks, p.world_size))
        coords = groups.coords
        self.replica = coords["dp"]
        self.leader = coords["tp"] == coords["pp"] == coords["cp"] == 0
        self.serving = p.replica_ranks(p.serving(self.replica))  # its first rank answers
        self.expected: dict[int, int] = {}  # requested batch -> weight version it is sampled with
        self.ready: dict[int, Result] = {}  # received ahead of their step (a save drains them)
        self.version: int | None = None
        self.published = 0
        self.probes: dict[int, torch.Tensor] = {}  # version -> the trainer's probe log-probs
        self._layout: list[list[_Tensor]] | None = None

    # -- weights ------------------------------------------------------------------------------
    def publish(self, version: int) -> dict[str, float]:
        """Send the student's weights (after step ``version``) to every rollout rank. The
        trainer's replica 0 gathers them (collectives over its ranks); its rank 0 broadcasts."""
        from megatron_gndpo.weight_sync.gather import iter_hf_weights

        started = time.perf_counter()
        self.published += 1
        check = check_due(self.cfg.rollout.weight_sync_check, self.published)
        coords, total = self.groups.coords, 0
        buckets: list[list[_Tensor]] = []
        flats: list[torch.Tensor] = []
        if coords["dp"] == 0 and coords["cp"] == 0:  # replica 0 gathers the full tensors
            weights = iter_hf_weights(
                self.student, self.groups, self.cfg.model, family=self.cfg.model.hf_family
            )
            for bucket in bucketed(weights, DEFAULT_BUCKET_BYTES):
                if self.bridge.rank == 0:
                    metas = [_meta(n, t) for n, t in bucket]
                    buckets.append(metas)
                    flats.append(torch.cat([_as_bytes(t) for _, t in bucket]))
                    total += flats[-1].numel()
                del bucket
        if self.bridge.rank == 0:
            for rank in self.rollout_ranks:
                self.bridge.send(("weights", version, buckets, check), rank)
            for flat in flats:
                self.bridge.broadcast(flat)  # the rollout ranks take it when they are done
        if check:  # the trainer's own probe of these weights, compared when a batch returns
            self.probes[version] = self.model_probe(
                self.student, self.groups, vocab_size=self.cfg.model.vocab_size
            )
        self.version = version
        return {
            "weight_sync/bytes": float(total),
            "weight_sync/buckets": float(len(flats)),
            "weight_sync/seconds": time.perf_counter() - started,
        }

    # -- batches ------------------------------------------------------------------------------
    def request(self, batch: int, ids: list[list[int]], seeds: list[int], params: Any) -> None:
        """Ask for this replica's rows of ``batch``, sampled with the last published weights."""
        assert self.version is not None, "publish the weights before requesting a batch"
        if self.bridge.rank == 0:
            for rank in self.rollout_ranks:
                self.bridge.send(("batch", batch), rank)
        if self.leader:
            request = Request(batch, self.replica, ids, seeds, params)
            for rank in self.serving:
                self.bridge.send(request, rank)
        self.expected[batch] = self.version

    def take(self, batch: int) -> tuple[Result, dict[str, float]]:
        """This replica's rollout of ``batch`` (waiting for it), checked, and its metrics."""
        from megatron_gndpo.weight_sync.check import agree

        started = time.perf_counter()
        result = self.ready.pop(batch, None)
        if result is None:
            result = self.bridge.recv(self.serving[0])
        waited = time.perf_counter() - started
        version = self.expected.pop(batch, None)
        if result.batch != batch or result.replica != self.replica or result.version != version:
            raise RuntimeError(
                f"the rollout ranks returned batch {result.batch} of replica {result.replica} "
                f"sampled with the weights of step {result.version}; expected batch {batch} of "
                f"replica {self.replica} with those of step {version} (a bug: please report it)"
            )
        metrics = {
            "async/staleness": float(batch - 1 - result.version),
            "async/wait_s": waited,
            "async/generate_s": result.seconds,
        }
        # The first batch of a checked version carries the rollout copy's probe (the same on
        # every replica: the rollout ranks attach it to all requests of that batch).
        reference = self.probes.get(result.version)
        if reference is not None and result.probe is not None:
            del self.probes[result.version]
            diff = probe_difference(result.probe, reference)
            metrics |= agree(diff, tolerance_of(self.cfg.rollout, self.cfg.model.params_dtype))
        for older in [v for v in self.probes if v < result.version]:
            del self.probes[older]  # its probe never came back (a batch from a checkpoint)
        return result, metrics

    def drain(self) -> list[int]:
        """Receive every requested batch now (before a checkpoint); returns their numbers."""
        for batch in sorted(self.expected):
            if batch not in self.ready:
                self.ready[batch] = self.bridge.recv(self.serving[0])
        return sorted(self.expected)

    def inflight(self) -> dict[int, Result]:
        """The drained batches not yet trained on (after :meth:`drain`)."""
        return {b: self.ready[b] for b in sorted(self.expected)}

    def restore(self, results: dict[int, Result]) -> None:
        """Batches sampled before a checkpoint: they are taken instead of requested again."""
        for batch, result in results.items():
            self.ready[batch] = result
            self.expected[batch] = result.version

    def stop(self) -> None:
        """End the rollout ranks' loop (trainer rank 0 sends; every rank waits for its sends)."""
        if self.bridge.rank == 0:
            for rank in self.rollout_ranks:
                self.bridge.send(("stop",), rank)
        self.bridge.flush()


def _meta(name: str, tensor: torch.Tensor) -> _Tensor:
    return _Tensor(name, tuple(tensor.shape), tensor.dtype, tensor.numel() * tensor.element_size())


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8)


def save_inflight(directory: Path, remote: RemoteRollouts, drawn: dict[int, Any]) -> None:
    """Write this replica's drained batches (after :meth:`RemoteRollouts.drain`), with the
    prompts each was drawn from (``drawn``, by batch), into a checkpoint's step directory; the
    replica's leader writes, before the checkpoint's checksums are taken."""
    if remote.leader and remote.inflight():
        out = directory / INFLIGHT_DIR
        out.mkdir(parents=True, exist_ok=True)
        batches = {b: (_plain(result), drawn[b]) for b, result in remote.inflight().items()}
        torch.save(batches, out / f"dp{remote.replica}.pt")


def _plain(result: Result) -> dict[str, Any]:
    """A result as tensors, numbers, strings and containers only: what ``torch.load(...,
    weights_only=True)`` reads back without running code (a checkpoint is not trusted)."""
    out = {f.name: getattr(result, f.name) for f in dataclasses.fields(result)}
    out["rollout"] = {
        f.name: getattr(result.rollout, f.name) for f in dataclasses.fields(result.rollout)
    }
    return out


def load_inflight(directory: Path, replica: int) -> dict[int, tuple[Result, Any]]:
    """What :func:`save_inflight` wrote for ``replica``: by batch, (result, drawn prompts)."""
    path = directory / INFLIGHT_DIR / f"dp{replica}.pt"
    # weights_only: plain data; our two dataclasses admitted for files written before (they
    # pickled them): constructing them runs no code of the file's choosing
    with torch.serialization.safe_globals([Result, Rollout]):
        saved = torch.load(path, weights_only=True)
    out = {}
    for batch, (fields, drawn) in saved.items():
        if not isinstance(fields, Result):
            fields = Result(**{**fields, "rollout": Rollout(**fields["rollout"])})
        out[int(batch)] = (fields, (drawn[0], list(drawn[1])))
    return out


# ---------------------------------------------------------------------------------------------
# The rollout ranks' side


class RolloutWorker:
    """A rollout rank: builds the student's copy and the generator, then serves the trainer."""

    def __init__(self, cfg: Config, *, probe: ModelProbe) -> None:
        from megatron_gndpo.data import load_tokenizer
        from megatron_gndpo.data.vocab import scoring_vocab
        from megatron_gndpo.models.build import build_model
        from megatron_gndpo.parallel.groups import build_student_groups
        from megatron_gndpo.rollout.builtin import MegatronGenerator

        b = bridge()
        assert b is not None, "a rollout rank needs init_distributed(rollout_ranks=...)"
        self.bridge, self.cfg, self.model_probe = b, cfg, probe
        p = placement_of(cfg, b)
        d = cfg.rollout.disaggregate
        self.parallel = dataclasses.replace(
            cfg.parallel, tensor_parallel=d.tensor_parallel, pipeline_parallel=1,
            context_parallel=1, expert_parallel=1, sequence_parallel=False,
        )  # fmt: skip
        layout = ParallelLayout(p.rollout_ranks, tp=d.tensor_parallel)
        self.tokenizer = load_tokenizer(cfg.data.tokenizer)
        vocab = scoring_vocab(cfg, self.tokenizer)
        self.engine: Any = None  # vLLM (rollout.engine=vllm), else the built-in generator:
        self.model: Any = None
        self.groups: ParallelGroups | None = None
        if cfg.rollout.engine == "vllm":
            self.engine = _vllm_engine(cfg, vocab, self.tokenizer.pad_id)
        else:
            self.groups = build_student_groups(layout, seed=cfg.trainer.seed)
            torch.manual_seed(cfg.trainer.seed)  # overwritten by the first weights
            self.model = build_model(cfg.model, self.parallel, self.groups)
            self.engine = MegatronGenerator(
                self.model, self.groups, vocab_size=vocab, pad_id=self.tokenizer.pad_id,
                max_sequence_length=cfg.model.max_position_embeddings,
            )  # fmt: skip
        trainers = trainer_layout(cfg, p.trainer_ranks)
        coords = layout.coords(torch.distributed.get_rank())
        self.replica = coords["dp"]
        self.leader = coords["tp"] == 0
        # the trainer replicas this rollout replica samples for, and who asks and who receives
        self.served = [r for r in range(trainers.dp) if p.serving(r) == self.replica]
        self.askers = {r: _leader(trainers, r) for r in self.served}
        replica_of = ("tp", "cp", "pp")  # the ranks of a data-parallel replica differ only there
        self.receivers = {r: trainers.group_of(self.askers[r], replica_of) for r in self.served}
        self.version: int | None = None
        self.probe: torch.Tensor | None = None

    def run(self) -> None:
        """Obey the trainer's rank 0 until it says stop."""
        while True:
            command = self.bridge.recv(0)
            if command[0] == "stop":
                break
            if command[0] == "weights":
                self._load(*command[1:])
            else:
                self._sample(command[1])
        self.bridge.flush()

    def _load(self, version: int, buckets: list[list[_Tensor]], check: bool) -> None:
        """Load weights version ``version`` a bucket (whole layers) at a time, as the colocated
        sync does: one bucket of the broadcast is held at once, never the whole student."""
        vocab = self.cfg.model.vocab_size
        self.version, self.probe = version, None
        if self.model is None:  # vLLM
            for bucket in self._receive(buckets):
                self.engine.load_weights(bucket)
                del bucket
            if check:
                self.probe = self.engine.prompt_logprobs(probe_tokens(vocab)).float().cpu()
            return
        assert self.groups is not None  # the built-in copy: its TP shard of each bucket's layers
        fill_by_bucket(
            self.model, self._receive(buckets), self.cfg.model,
            tp=self.parallel.tensor_parallel, tp_rank=self.groups.coords["tp"],
        )  # fmt: skip
        if check:
            self.probe = self.model_probe(self.model, self.groups, vocab_size=vocab)

    def _receive(self, buckets: list[list[_Tensor]]) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The broadcast's buckets in order, each as (Hugging Face name, tensor) views of it."""
        for metas in buckets:
            flat = torch.empty(sum(m.nbytes for m in metas), dtype=torch.uint8)
            self.bridge.broadcast(flat).wait()
            offset, bucket = 0, []
            for m in metas:
                raw = flat[offset : offset + m.nbytes]
                bucket.append((m.name, raw.view(m.dtype).reshape(m.shape)))
                offset += m.nbytes
            yield bucket
            del flat, bucket  # before the next bucket's buffer: one held at once

    def _sample(self, batch: int) -> None:
        assert self.version is not None, "the trainer sends the weights before any batch"
        for replica in self.served:
            request: Request = self.bridge.recv(self.askers[replica])
            if request.batch != batch or request.replica != replica:
                raise RuntimeError(
                    f"rollout replica {self.replica} expected batch {batch} of trainer replica "
                    f"{replica}, got batch {request.batch} of {request.replica} (a bug)"
                )
            started = time.perf_counter()
            rollout = self.engine.generate(request.ids, request.params, seeds=request.seeds)
            result = Result(
                batch, replica, rollout, self.version, time.perf_counter() - started, self.probe
            )
            if self.leader:
                for rank in self.receivers[replica]:
                    self.bridge.send(result, rank)
        self.probe = None  # sent with the first batch of its version


def _vllm_engine(cfg: Config, vocab: int, pad_id: int) -> Any:
    """A vLLM engine per rollout replica, in the rollout ranks' world (vLLM's external launcher
    builds its groups from the world it finds: the rollout ranks'); dummy weights until the
    first broadcast."""
    import os

    from megatron_gndpo.parallel.distributed import barrier
    from megatron_gndpo.rollout.vllm_engine import VLLMGenerator, write_engine_config

    engine_dir = Path(cfg.logging.run_dir) / "engine-rollout"
    if torch.distributed.get_rank() == 0:
        write_engine_config(
            engine_dir, cfg.model, family=cfg.model.hf_family, dtype=cfg.model.params_dtype
        )
    barrier()
    # vLLM reads torchrun's RANK and WORLD_SIZE: this rank's place in the rollout world
    os.environ["RANK"] = str(torch.distributed.get_rank())
    os.environ["WORLD_SIZE"] = str(torch.distributed.get_world_size())
    return VLLMGenerator(
        cfg.rollout, engine_dir, pad_id=pad_id,
        tensor_parallel_size=cfg.rollout.disaggregate.tensor_parallel,
        dtype=cfg.model.params_dtype, seed=cfg.trainer.seed,
        max_model_len=cfg.model.max_position_embeddings, vocab_size=vocab,
        model_vocab_size=cfg.model.vocab_size, head_dim=cfg.model.head_dim,
    )  # fmt: skip


def fill_by_bucket(
    net: torch.nn.Module,
    buckets: Iterable[list[tuple[str, torch.Tensor]]],
    model: ModelConfig,
    *,
    tp: int,
    tp_rank: int,
) -> None:
    """Fill this rank's TP shard ``net`` from Hugging Face tensors that arrive in buckets (the
    weight broadcast): each parameter is copied from the bucket that holds its tensors (a bucket
    holds whole layers: :func:`~megatron_gndpo.weight_sync.buckets.bucketed`, and a parameter's
    tensors, fused q/k/v or gate/up, are one layer's), so only the current bucket is held."""
    from megatron_gndpo.checkpoint.convert import fill_from_hf
    from megatron_gndpo.checkpoint.hf_mapping import global_names, mapping_for

    readers: dict[str, list[str]] = {}  # Hugging Face name -> the parameters made from it
    for _, full, _ in global_names(net):
        for name in mapping_for(full, model).hf:
            readers.setdefault(name, []).append(full)
    unfilled = {full for fulls in readers.values() for full in fulls}
    for bucket in buckets:
        named = _Named(dict(bucket))
        ready = {full for name in named.tensors for full in readers.get(name, ())}
        fill_from_hf(net, named, model, tp=tp, tp_rank=tp_rank, only=ready)
        unfilled -= ready
        del named, bucket
    if unfilled:
        raise WeightSyncError(
            f"the weights sent to the rollout ranks left {len(unfilled)} parameters unfilled "
            f"(first: {min(unfilled)}): the trainer and the rollout ranks disagree on the model "
            "(a bug: please report it)"
        )


class _Named:
    """A received state dict as :func:`~megatron_gndpo.checkpoint.convert.fill_from_hf` reads
    a checkpoint: by name."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def get(self, name: str) -> torch.Tensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise WeightSyncError(
                f"the weights sent to the rollout ranks have no {name}: the trainer and the "
                "rollout ranks disagree on the model (a bug: please report it)"
            ) from None
