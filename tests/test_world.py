"""``parallel/world.py``: the one-process world the demo, prune, the HF export and the benchmarks
build models in. It starts what does not run yet and tears down only what it started."""

from __future__ import annotations

import pytest
import torch.distributed as dist

pytestmark = [pytest.mark.megatron]


def test_one_process_world_starts_and_tears_down_both() -> None:
    from megatron.core import parallel_state

    from megatron_gndpo.parallel.world import distributed_world, one_process_world

    if dist.is_initialized():
        pytest.skip("torch.distributed is already initialised in this process")
    with one_process_world(seed=3) as groups:
        assert dist.get_world_size() == 1 and parallel_state.model_parallel_is_initialized()
        assert groups.name == "student" and groups.layout.world_size == 1
        # nested with reuse: groups of its own beside the running state, which it leaves up
        with one_process_world(reuse=True) as export:
            assert export.name == "export"
        assert parallel_state.model_parallel_is_initialized()
        # nested without reuse: refused, the running state untouched
        with pytest.raises(RuntimeError, match="already initialised"), one_process_world():
            pass
        assert parallel_state.model_parallel_is_initialized()
    assert not dist.is_initialized() and not parallel_state.model_parallel_is_initialized()

    # a world started outside is used and left running; the megatron state made here is not
    with distributed_world(alone="the test") as world:
        assert world == 1
        with one_process_world(seed=0):
            assert parallel_state.model_parallel_is_initialized()
        assert dist.is_initialized() and not parallel_state.model_parallel_is_initialized()
    assert not dist.is_initialized()


def _refused_in_two(rank: int, world: int) -> str:
    from megatron_gndpo.errors import DistributedStartError
    from megatron_gndpo.parallel.world import distributed_world

    try:
        with distributed_world(alone="the test"):
            return "entered"
    except DistributedStartError as err:
        assert dist.is_initialized()  # the launcher's world is not this one's to end
        return str(err)


@pytest.mark.distributed
def test_a_larger_world_is_refused_naming_who_needs_one_process() -> None:
    from tests.harness import run_distributed

    said = run_distributed(_refused_in_two, 2)
    assert said == ["the test runs as one process, not 2: start it without a launcher"] * 2
