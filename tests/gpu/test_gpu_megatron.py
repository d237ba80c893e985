"""GPU: one Megatron GPTModel step with the ring spec vs the local spec (CP=1, one GPU, NCCL world of
one): same loss and gradients. Skipped without CUDA (tests/gpu/conftest.py); not run here (no GPU)."""

import pytest
import torch
import torch.distributed as dist



@pytest.fixture
def one_gpu_megatron():
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    torch.cuda.set_device(0)
    ps.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    try:
        yield
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def test_gpt_step_ring_spec_equals_local_spec_on_gpu(one_gpu_megatron):
    from tests.megatron.megatron_workers import MODEL, _build, make_batch

    batch = {k: v.cuda() for k, v in make_batch(MODEL, 0, 2).items()}
    results = []
    for ring in (False, True):
        model = _build(MODEL, 1, 1, ring=ring).cuda()
        tok = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        loss = (tok * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
        loss.backward()
        results.append((loss.item(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}))
    (l0, g0), (l1, g1) = results
    assert abs(l0 - l1) < 1e-4 * abs(l0)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], atol=1e-4, rtol=1e-3)
