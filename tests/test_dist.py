"""dist.py's collectives between real processes (gloo on the CPU): the data-parallel gradient mean the loop takes
instead of DDP's, the start-up broadcast of the adapters, and of rank 0's FP8 codes."""
import os
import socket

import pytest
import torch
import torch.distributed as tdist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, out: dict) -> None:
    from raytrain_scu.core.dist import average_gradients, broadcast_params

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    tdist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        params = [torch.nn.Parameter(torch.full((3,), float(rank))), torch.nn.Parameter(torch.zeros(2, 2)),
                  torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))]
        broadcast_params(params)  # rank 0's values everywhere
        params[0].grad = torch.tensor([1.0, 2.0, 3.0]) * (rank + 1)  # rank 0: 1,2,3; rank 1: 2,4,6
        params[1].grad = torch.full((2, 2), 4.0) if rank == 0 else None  # no gradient on rank 1: zeros there
        params[2].grad = torch.tensor([10.0 * rank], dtype=torch.float64)
        average_gradients(params)
        out[rank] = [params[0].detach().clone()] + [p.grad.clone() for p in params]
    finally:
        tdist.destroy_process_group()


@pytest.mark.slow
def test_gradients_become_their_mean_over_ranks_and_parameters_start_from_rank_0():
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_worker, args=(_free_port(), out), nprocs=2, join=True)
        results = dict(out)
    for rank in (0, 1):
        value, g0, g1, g2 = results[rank]
        assert torch.equal(value, torch.zeros(3))  # rank 0's value, on rank 1 too
        assert torch.equal(g0, torch.tensor([1.5, 3.0, 4.5]))  # the mean, not the sum
        assert torch.equal(g1, torch.full((2, 2), 2.0))
        assert g2.dtype == torch.float64 and torch.equal(g2, torch.tensor([5.0], dtype=torch.float64))


def test_one_process_leaves_gradients_alone():
    from raytrain_scu.core.dist import average_gradients

    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([1.0, 3.0])
    average_gradients([p])
    assert torch.equal(p.grad, torch.tensor([1.0, 3.0]))


def _codes_worker(rank: int, port: int, out: dict) -> None:
    from test_fp8 import VOCAB, lora_model

    from raytrain_scu.core.fp8_gptq import convert_base_to_fp8_gptq
    from raytrain_scu.worker.build import share_rank0_codes

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    tdist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        model = lora_model()  # the same seeded model on both ranks
        g = torch.Generator().manual_seed(100 + rank)  # each rank calibrates on its own blocks: other codes
        convert_base_to_fp8_gptq(model, [torch.randint(0, VOCAB, (4, 64), generator=g) for _ in range(2)])

        def codes():
            return [m.base_layer.fp8_weight.clone() for m in model.modules() if hasattr(m, "base_layer")]

        before = codes()
        share_rank0_codes(model)
        out[rank] = (before, codes())
    finally:
        tdist.destroy_process_group()


@pytest.mark.slow
def test_every_rank_runs_rank_0s_fp8_codes():
    from test_fp8 import CPU_FP8_MISSING

    if CPU_FP8_MISSING:
        pytest.skip(CPU_FP8_MISSING)
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_codes_worker, args=(_free_port(), out), nprocs=2, join=True)
        (before0, after0), (before1, after1) = out[0], out[1]
    assert len(after0) == 2 * 7 and any(not torch.equal(a, b) for a, b in zip(before0, before1))
    assert all(torch.equal(a, b) for a, b in zip(after0, after1)) and all(
        torch.equal(a, b) for a, b in zip(before0, after0))
