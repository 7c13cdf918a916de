"""Distributed start-up: reading torchrun's and Slurm's variables, and initialising once."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist

from megatron_gndpo.parallel.distributed import (
    DistributedEnv,
    default_backend,
    detect_env,
    expand_slurm_nodelist,
    init_distributed,
    shutdown_distributed,
)

TORCHRUN = {
    "RANK": "5",
    "WORLD_SIZE": "16",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "4",
    "MASTER_ADDR": "node-a",
    "MASTER_PORT": "29611",
}

SLURM = {
    "SLURM_PROCID": "13",
    "SLURM_NTASKS": "32",
    "SLURM_LOCALID": "5",
    "SLURM_JOB_NODELIST": "gpu-[001-003,010],login7",
    "SLURM_TASKS_PER_NODE": "8(x4)",
    "SLURM_JOB_ID": "123456",
}


def test_torchrun_variables() -> None:
    env = detect_env(TORCHRUN)
    assert env == DistributedEnv(
        rank=5,
        world_size=16,
        local_rank=1,
        local_world_size=4,
        master_addr="node-a",
        master_port=29611,
        launcher="torchrun",
    )


def test_torchrun_defaults_for_optional_variables() -> None:
    env = detect_env({"RANK": "0", "WORLD_SIZE": "2"})
    assert (env.local_rank, env.local_world_size) == (0, 2)
    assert (env.master_addr, env.master_port, env.launcher) == ("127.0.0.1", 29500, "torchrun")


def test_slurm_variables() -> None:
    env = detect_env(SLURM)
    assert env.launcher == "slurm"
    assert (env.rank, env.world_size, env.local_rank) == (13, 32, 5)
    assert env.local_world_size == 8  # "8(x4)": 8 tasks on each of 4 nodes
    assert env.master_addr == "gpu-001"  # the first host of the node list
    assert env.master_port == 10000 + 123456 % 20000  # from the job id: same on every task


def test_slurm_port_depends_on_the_job_and_stays_in_range() -> None:
    ports = {
        detect_env(SLURM | {"SLURM_JOB_ID": str(j)}).master_port for j in range(0, 10**6, 7919)
    }
    assert len(ports) > 100  # different jobs on one node get different ports
    assert all(10000 <= p < 30000 for p in ports)


def test_slurm_master_port_and_addr_override() -> None:
    env = detect_env(SLURM | {"MASTER_PORT": "40001", "MASTER_ADDR": "10.0.0.9"})
    assert (env.master_addr, env.master_port) == ("10.0.0.9", 40001)


def test_slurm_ntasks_per_node_and_uneven_tasks_per_node() -> None:
    assert detect_env(SLURM | {"SLURM_NTASKS_PER_NODE": "4"}).local_world_size == 4
    assert detect_env(SLURM | {"SLURM_TASKS_PER_NODE": "6,2(x3)"}).local_world_size == 6


def test_slurm_nodelist_alias() -> None:
    env = {k: v for k, v in SLURM.items() if k != "SLURM_JOB_NODELIST"}
    assert detect_env(env | {"SLURM_NODELIST": "n[07-08]"}).master_addr == "n07"


def test_slurm_without_nodelist_is_an_error() -> None:
    env = {k: v for k, v in SLURM.items() if k != "SLURM_JOB_NODELIST"}
    with pytest.raises(RuntimeError) as err:
        detect_env(env)
    assert "SLURM_JOB_NODELIST" in str(err.value)
    assert "srun" in str(err.value) and "torchrun" in str(err.value)


def test_torchrun_wins_over_slurm() -> None:
    # One torchrun per node under srun: Slurm's variables describe the node task, not the rank.
    env = detect_env(SLURM | TORCHRUN)
    assert env.launcher == "torchrun"
    assert (env.rank, env.world_size, env.master_addr) == (5, 16, "node-a")


def test_nothing_set_is_a_single_process_on_a_free_port() -> None:
    env = detect_env({})
    assert env.launcher == "single"
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (0, 1, 0, 1)
    assert env.master_addr == "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", env.master_port))  # still free


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("gpu-[001-003,010],login7", ["gpu-001", "gpu-002", "gpu-003", "gpu-010", "login7"]),
        ("n[08-11]", ["n08", "n09", "n10", "n11"]),  # zero padding kept across a digit change
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("n[9-10]", ["n9", "n10"]),  # no padding
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("a[1,3],b[2-3]", ["a1", "a3", "b2", "b3"]),
        ("login1", ["login1"]),
        ("login1,login2", ["login1", "login2"]),
        (" node5 ", ["node5"]),
    ],
)
def test_expand_slurm_nodelist(nodelist: str, hosts: list[str]) -> None:
    assert expand_slurm_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist", ["", "  ", ","])
def test_empty_nodelist_is_an_error(nodelist: str) -> None:
    with pytest.raises(ValueError, match="names no host"):
        expand_slurm_nodelist(nodelist)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA machines use NCCL")
def test_default_backend_is_gloo_without_cuda() -> None:
    assert default_backend() == "gloo"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_nccl_without_a_gpu_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="has no GPU"):
        init_distributed(detect_env({}), backend="nccl")
    assert not dist.is_initialized()


def test_init_distributed_once_then_mismatch_raises() -> None:
    if dist.is_initialized():
        pytest.skip("torch.distributed is already initialised in this process")
    env = detect_env({})
    try:
        assert init_distributed(env, timeout_s=60) == env
        assert dist.is_initialized()
        assert (dist.get_rank(), dist.get_world_size()) == (0, 1)
        assert dist.get_backend() == default_backend()
        # A real collective on the group it made.
        t = torch.tensor([3.0])
        dist.all_reduce(t)
        assert t.item() == 3.0
        # Again with the same world: returns without re-initialising.
        assert init_distributed(env) == env
        # Again with a world that does not match: a clear error, not a second init.
        other = DistributedEnv(0, 2, 0, 2, "127.0.0.1", env.master_port, "torchrun")
        with pytest.raises(RuntimeError) as err:
            init_distributed(other)
        assert "already initialised as rank 0 of 1" in str(err.value)
        assert "rank 0 of 2" in str(err.value)
        assert "do not initialise it twice" in str(err.value)
        assert dist.get_world_size() == 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_gpu_default_backend_pairs_nccl_with_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    # CPU tensors (flags, metric sums) must still have a backend on GPU machines.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert default_backend() == "cpu:gloo,cuda:nccl"


def test_device_map_backend_reaches_new_groups() -> None:
    """The per-device backend syntax of the GPU default, exercised with its CPU half: groups
    created afterwards (as megatron's are) inherit it and reduce CPU tensors."""
    if dist.is_initialized():
        pytest.skip("torch.distributed is already initialised in this process")
    try:
        init_distributed(detect_env({}), backend="cpu:gloo", timeout_s=60)
        group = dist.new_group([0])
        t = torch.tensor([2.0])
        dist.all_reduce(t, group=group)
        assert t.item() == 2.0
    finally:
        shutdown_distributed()
