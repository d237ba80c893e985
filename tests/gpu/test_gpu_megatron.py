"""One Megatron GPTModel step with the ring spec vs the local spec at CP=1 on one device (a one-rank
process group, in this process): same loss and gradients within the model-level bound
(tests/helpers/numerics.py). Context parallelism is initialised as a user does, with
``initialize_context_parallel(RingConfig(...))``. The ``cpu`` variant (gloo, the lab's CPU support) runs
in CI; the ``cuda`` one (NCCL) where a GPU is. Negative control: the local spec on another batch is over
the loss bound."""
import contextlib

import pytest
import torch
import torch.distributed as dist

from tests.helpers.numerics import Checks, add_model_grads, model_loss_tol


@pytest.fixture(params=["cpu", "cuda"])
def device(request):
    """A one-rank world with Megatron's model parallel state and the ring's CP=1 registered; the device."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from megatron_ring.megatron import RingConfig, destroy_context_parallel, initialize_context_parallel
    from megatron_ring_lab.cpu import megatron_cpu
    from tests.megatron.megatron_workers import MODEL

    dev = request.param
    if dev == "cpu" and torch.cuda.is_available():
        pytest.skip("the CPU variant (the lab's CPU support patches Megatron) runs where there is no GPU (CI)")
    with contextlib.ExitStack() as stack:
        if dev == "cpu":
            stack.enter_context(megatron_cpu())
        else:
            torch.cuda.set_device(0)
        dist.init_process_group("gloo" if dev == "cpu" else "nccl", store=dist.HashStore(), rank=0, world_size=1)
        try:
            initialize_context_parallel(RingConfig(context_parallel_size=1), seq_length=MODEL["seq"])
            tensor_parallel.model_parallel_cuda_manual_seed(MODEL["seed"], force_reset_rng=True)
            yield dev
        finally:
            destroy_context_parallel()
            ps.destroy_model_parallel()
            dist.destroy_process_group()


def _step(ring, batch, dev):
    from tests.megatron.megatron_workers import MODEL, _build

    model = _build(MODEL, 1, 1, ring=ring).to(dev)
    tok = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    loss = (tok * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
    loss.backward()
    return loss.item(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def test_gpt_step_ring_spec_equals_local_spec_on_gpu(device):
    from tests.megatron.megatron_workers import MODEL, make_batch, sizes

    batch = {k: v.to(device) for k, v in make_batch(MODEL, 0, MODEL["micro_batch"]).items()}
    (l0, g0), (l1, g1) = _step(False, batch, device), _step(True, batch, device)
    checks = Checks(f"GPT step ring spec vs local spec at CP=1 on {device}")
    checks.add("loss", abs(l1 - l0), model_loss_tol(l0, **sizes()))
    add_model_grads(checks, g1, g0, **sizes())
    checks.check(min_rows=1 + len(g0))
    other = {k: v.to(device) for k, v in make_batch(MODEL, 1, MODEL["micro_batch"]).items()}
    l_other, _ = _step(False, other, device)  # negative control: another batch
    assert abs(l_other - l0) > 10 * model_loss_tol(l0, **sizes()), (l_other, l0)
