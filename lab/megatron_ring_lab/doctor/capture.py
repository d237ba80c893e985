"""What one doctor run records, inside each training process (imported by :mod:`.entry`, never by the library).

:func:`install` wraps a few functions of Megatron-LM's training loop (module attributes, replaced for the
life of the process, which runs only this job) and :func:`write` saves, per rank, ``rank<N>.pt`` in the run's
folder:

* per iteration: the loss-function outputs of every micro-batch on this rank (``{key: [sum, count]}`` or
  ``[value]``, before any reduction), the loss dict the loop reports (``train_step``'s return), every extra
  term the loop logs (multi-token prediction, MoE aux / z-loss: what ``track_mtp_metrics`` and the MoE
  tracker's ``report`` add to the logged dict) and the grad norm ``optimizer.step()`` returns;
* iteration 1, per micro-batch: the inputs the model got (tokens, labels, position ids, the first visible key
  of every query row of a ``[b, 1, s, S]`` attention mask), its per-token loss, and the rotary embedding
  slice the first self-attention layer got;
* the parameters before step 1, every parameter's gradient as the optimizer sees it in step 1 (after the
  reduction over DP x CP, before clipping) and the parameters after the last iteration;
* each evaluation's loss dict.

Parameter names use global layer numbers (``decoder.layers.<layer_number - 1>``), so pipeline stages line up.
Every wrapper and hook reads Megatron's arguments by parameter name (``inspect.signature(...).bind``), never by
position; the names it relies on are entries of ``megatron_ring/megatron/contract.py`` (``doctor-*``).
"""
from __future__ import annotations

import functools
import inspect
import os
import re
from typing import Any

import torch

from megatron_ring import settings

#: the environment variable naming the folder a run writes to
OUT_ENV = settings.DOCTOR_OUT  # the record folder (read by entry.py through settings)

_state: dict[str, Any] = {"iteration": 0, "iters": {}, "tokens": [], "eval": [], "grads1": None,
                          "init_params": None, "final_params": None, "model": None, "hooked": False,
                          "notes": []}


def _it() -> dict[str, Any]:
    return _state["iters"].setdefault(_state["iteration"], {"micro": [], "train": [], "reported": {},
                                                            "logged": {}, "grad_norm": None})


def _floats(v: Any) -> list[float]:
    if isinstance(v, torch.Tensor):
        return [float(x) for x in v.detach().double().reshape(-1).tolist()]
    if isinstance(v, (list, tuple)):
        return [float(x) for x in v]
    return [float(v)]


def _unwrap(m: Any) -> Any:
    while hasattr(m, "module"):
        m = m.module
    return m


def _global_names(chunk: torch.nn.Module) -> dict[str, str]:
    """Local parameter name -> name with the global layer number (pipeline stages renumber from 0)."""
    rename: dict[str, str] = {}
    for mod_name, mod in chunk.named_modules():
        m = re.fullmatch(r"(.*\blayers)\.(\d+)", mod_name)
        if m and isinstance(getattr(mod, "layer_number", None), int):
            rename[mod_name + "."] = f"{m.group(1)}.{mod.layer_number - 1}."
    out = {}
    for name, _ in chunk.named_parameters():
        new = name
        for old_prefix in sorted(rename, key=len, reverse=True):
            if name.startswith(old_prefix):
                new = rename[old_prefix] + name[len(old_prefix):]
                break
        out[name] = new
    return out


def _named(model: list, what: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for chunk in model:
        inner = _unwrap(chunk)
        names = _global_names(inner)
        for name, p in inner.named_parameters():
            if what == "param":
                t = p
            else:
                t = getattr(p, "main_grad", None)
                if t is None:
                    t = p.grad
                if t is None:
                    continue
            out[names[name]] = t.detach().float().clone()
    return out


def _arguments(sig: inspect.Signature, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The arguments of one call by parameter name (those passed; defaults left out)."""
    return sig.bind_partial(*args, **kwargs).arguments


def _hook_model(model: list) -> None:
    """Forward hooks that record iteration 1's inputs, per-token loss and the first rotary slice."""
    from megatron.core.transformer.attention import SelfAttention

    if _state["hooked"]:
        return
    _state["hooked"] = True

    def active() -> bool:
        return _state["iteration"] == 1 and _state.get("training", False)

    for chunk in model:
        inner = _unwrap(chunk)
        forward = inspect.signature(inner.forward)  # GPTModel / HybridModel: input_ids, position_ids, ...

        def pre(mod, args, kwargs, forward=forward):
            if not active():
                return
            got = _arguments(forward, args, kwargs)
            rec: dict[str, Any] = {"packed": got.get("packed_seq_params") is not None}
            for n in ("input_ids", "position_ids", "labels"):
                if isinstance(got.get(n), torch.Tensor):
                    rec[n] = got[n].detach().clone()
            mask = got.get("attention_mask")
            if isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.dtype == torch.bool:
                visible = ~mask[:, 0]
                j = torch.arange(mask.shape[-1])
                rec["first_key"] = torch.where(visible, j, mask.shape[-1]).amin(-1)
            _state["tokens"].append(rec)

        def post(mod, args, kwargs, output, forward=forward):
            if not active() or not _state["tokens"]:
                return
            if isinstance(output, torch.Tensor) and _arguments(forward, args, kwargs).get("labels") is not None:
                _state["tokens"][-1]["loss"] = output.detach().float().clone()

        inner.register_forward_pre_hook(pre, with_kwargs=True)
        inner.register_forward_hook(post, with_kwargs=True)
        for mod in inner.modules():
            if isinstance(mod, SelfAttention):
                attention = inspect.signature(mod.forward)

                def rope_pre(m, args, kwargs):
                    rot = _arguments(attention, args, kwargs).get("rotary_pos_emb")
                    if active() and _state["tokens"] and isinstance(rot, torch.Tensor) \
                            and "rope" not in _state["tokens"][-1]:
                        _state["tokens"][-1]["rope"] = rot.detach().float().reshape(rot.shape[0], -1).clone()
                mod.register_forward_pre_hook(rope_pre, with_kwargs=True)
                break


def _wrap_fbf(fbf: Any) -> Any:
    sig = inspect.signature(fbf)

    @functools.wraps(fbf)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        forward_only = _arguments(sig, args, kwargs).get("forward_only", False)
        out = fbf(*args, **kwargs)
        if not forward_only and isinstance(out, list):
            _it()["micro"] = [{k: _floats(v) for k, v in d.items()} for d in out if isinstance(d, dict)]
        return out
    return wrapped


def _wrap_step(step: Any, model: list) -> Any:
    @functools.wraps(step)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if _state["iteration"] == 1:
            _state["grads1"] = _named(model, "grad")
        out = step(*args, **kwargs)
        if isinstance(out, tuple) and len(out) >= 2 and out[1] is not None:
            _it()["grad_norm"] = float(out[1])
        return out
    return wrapped


def _wrap_forward_step(forward_step: Any) -> Any:
    """Record what each micro-batch's loss function returns for training: (loss, token count) or (loss,)."""
    @functools.wraps(forward_step)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        out = forward_step(*args, **kwargs)
        if not (isinstance(out, tuple) and len(out) == 2 and callable(out[1])):
            return out
        loss_func = out[1]

        def recorded(*a: Any, **k: Any) -> Any:
            res = loss_func(*a, **k)
            if _state.get("training") and isinstance(res, tuple) and len(res) >= 2:
                vals = [float(res[0].detach().double().sum())]
                if len(res) == 3:
                    vals.append(float(res[1]))
                _it()["train"].append(vals)
            return res
        return out[0], recorded
    return wrapped


def _wrap_train_step(train_step: Any) -> Any:
    sig = inspect.signature(train_step)

    @functools.wraps(train_step)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        call = sig.bind(*args, **kwargs)
        got = call.arguments
        model, optimizer = got["model"], got["optimizer"]
        _state["iteration"] += 1
        _state["model"] = model
        if _state["init_params"] is None:
            _state["init_params"] = _named(model, "param")
            _hook_model(model)
        if not getattr(optimizer, "_doctor_wrapped", False):
            optimizer.step = _wrap_step(optimizer.step, model)
            optimizer._doctor_wrapped = True
        if got.get("forward_backward_func") is not None:
            got["forward_backward_func"] = _wrap_fbf(got["forward_backward_func"])
        got["forward_step_func"] = _wrap_forward_step(got["forward_step_func"])
        _state["training"] = True
        try:
            out = train_step(*call.args, **call.kwargs)
        finally:
            _state["training"] = False
        if isinstance(out, tuple) and out and isinstance(out[0], dict):
            _it()["reported"] = {k: _floats(v)[0] for k, v in out[0].items()}
        _state["final_params"] = _named(model, "param")
        return out
    return wrapped


def _wrap_reporter(report: Any) -> Any:
    """``track_mtp_metrics`` / the MoE tracker's ``report``: record what they add to the logged dict."""
    sig = inspect.signature(report)

    @functools.wraps(report)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        call = sig.bind(*args, **kwargs)
        target = call.arguments.get("total_loss_dict")
        mine: dict[str, Any] = {}
        call.arguments["total_loss_dict"] = mine
        out = report(*call.args, **call.kwargs)
        _it()["logged"].update({k: _floats(v)[0] for k, v in mine.items()})
        if target is not None:
            for k, v in mine.items():
                target[k] = target.get(k, torch.zeros_like(v)) + v
        return out
    return wrapped


def _wrap_evaluate(evaluate: Any) -> Any:
    @functools.wraps(evaluate)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        out = evaluate(*args, **kwargs)
        if isinstance(out, tuple) and out and isinstance(out[0], dict):
            _state["eval"].append({"after": _state["iteration"],
                                   "losses": {k: _floats(v)[0] for k, v in out[0].items()}})
        return out
    return wrapped


def install() -> None:
    """Wrap Megatron-LM's ``train_step``, ``evaluate`` and the MTP / MoE loss reporters (for this process)."""
    from megatron.training import training

    training.train_step = _wrap_train_step(training.train_step)
    training.evaluate = _wrap_evaluate(training.evaluate)
    try:
        from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

        MTPLossLoggingHelper.track_mtp_metrics = staticmethod(
            _wrap_reporter(MTPLossLoggingHelper.track_mtp_metrics))
    except (ImportError, AttributeError):
        _state["notes"].append("multi-token prediction loss reporter not found: MTP loss not recorded")
    try:
        from megatron.core.transformer.moe import moe_utils

        cls = type(moe_utils.get_moe_metrics_tracker())
        cls.report = _wrap_reporter(cls.report)
    except (ImportError, AttributeError):
        _state["notes"].append("MoE metrics tracker not found: MoE aux losses not recorded")


def write(folder: str) -> None:
    """Save this rank's record as ``<folder>/rank<global rank>.pt``."""
    import torch.distributed as dist

    meta: dict[str, Any] = {"rank": int(os.environ.get("RANK", "0")), "notes": _state["notes"]}
    try:
        from megatron.core import parallel_state as ps

        meta.update(cp=ps.get_context_parallel_world_size(), cp_rank=ps.get_context_parallel_rank(),
                    pp=ps.get_pipeline_model_parallel_world_size(), pp_rank=ps.get_pipeline_model_parallel_rank(),
                    dp_rank=ps.get_data_parallel_rank(), tp_rank=ps.get_tensor_model_parallel_rank())
    except Exception as e:  # the run stopped before Megatron's groups existed
        meta["groups_error"] = repr(e)
    if dist.is_available() and dist.is_initialized():
        meta["rank"] = dist.get_rank()
    try:
        from megatron.training import get_args

        a = get_args()
        meta.update(seq_length=a.seq_length, train_iters=a.train_iters, num_layers=a.num_layers,
                    hidden_size=a.hidden_size, ffn_hidden_size=a.ffn_hidden_size,
                    global_batch_size=a.global_batch_size, lr=a.lr, hidden_dropout=a.hidden_dropout,
                    attention_dropout=a.attention_dropout, clip_grad=a.clip_grad)
    except Exception:
        pass
    rec = {k: _state[k] for k in ("iters", "tokens", "eval", "grads1", "init_params", "final_params")}
    rec["meta"] = meta
    torch.save(rec, os.path.join(folder, f"rank{meta['rank']}.pt"))
