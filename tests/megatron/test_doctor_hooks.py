"""The doctor's wrappers bind Megatron's arguments by name (``inspect.signature``), whichever way they are passed.

Stand-ins carry the installed Megatron function's signature (no training loop, no process started): the wrapped
``train_step`` must hand the callee its recording ``forward_step_func`` / ``forward_backward_func`` for positional
and keyword calls alike, and a wrapped loss reporter must find ``total_loss_dict`` wherever it was passed.
"""
from __future__ import annotations

import inspect

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from megatron_ring.megatron import compat  # noqa: E402
from megatron_ring_lab.doctor import capture  # noqa: E402


def stand_in(real, body):
    """A function with ``real``'s signature that calls ``body`` with its arguments by name."""
    sig = inspect.signature(real)

    def fn(*args, **kwargs):
        return body(sig.bind(*args, **kwargs).arguments)
    fn.__signature__ = sig
    return fn


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch):
    monkeypatch.setattr(capture, "_state", {**capture._state, "iters": {}, "tokens": [], "notes": [],
                                            "iteration": 0, "init_params": None, "hooked": False})


@pytest.mark.skipif(not compat.has_megatron_training(), reason="this megatron-core has no megatron.training")
@pytest.mark.parametrize("positional", [True, False])
def test_train_step_hook_binds_by_name(positional):
    from megatron.training import training

    seen = {}
    step = capture._wrap_train_step(stand_in(training.train_step, lambda a: seen.update(a) or ({"lm loss": 1.0},)))

    class Optimizer:
        def step(self):
            return True, None, 0

    args = dict(forward_step_func=lambda *a: None, data_iterator=None, model=[torch.nn.Linear(2, 2)],
                optimizer=Optimizer(), opt_param_scheduler=None, config=None, forward_backward_func=lambda **k: [])
    if positional:
        step(*args.values())
    else:
        step(**args)
    assert seen["forward_step_func"].__wrapped__ is args["forward_step_func"]
    assert seen["forward_backward_func"].__wrapped__ is args["forward_backward_func"]
    assert seen["model"] is args["model"] and capture._state["iteration"] == 1
    assert capture._it()["reported"] == {"lm loss": 1.0}


def test_loss_reporter_hook_finds_total_loss_dict():
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    def body(a):
        a["total_loss_dict"]["mtp_1 loss"] = torch.tensor(2.0)
    report = capture._wrap_reporter(stand_in(MTPLossLoggingHelper.track_mtp_metrics, body))
    by_position, by_name = {}, {"mtp_1 loss": torch.tensor(1.0)}
    report(1.0, 1, None, None, by_position)
    report(1.0, 1, None, total_loss_dict=by_name)
    assert float(by_position["mtp_1 loss"]) == 2.0 and float(by_name["mtp_1 loss"]) == 3.0
    assert capture._it()["logged"] == {"mtp_1 loss": 2.0}
