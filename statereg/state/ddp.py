"""DistributedDataParallel's gradient bucket layout as checkpoint state, for exact resume.

Why this exists (docs/exact-resume.md#under-ddp): DDP all-reduces gradients packed into flat
bucket buffers. A fresh `DistributedDataParallel` packs them in `module.parameters()` order;
after its first backward it rebuilds the buckets once, in the order the gradients became
ready (roughly the reverse). gloo (and NCCL) all-reduce a buffer in chunks, and the order in
which the ranks' values are summed depends on where an element lies in the buffer. With two
ranks that order cannot matter (a + b == b + a), with three or more it can: a float sum is not
associative. So the first step after a resume, which runs in a new DDP with the initial
layout, averages gradients in another order than the uninterrupted run, which is long past
its rebuild: about a third of the averaged gradient elements differ by an ulp, and the losses
drift apart from there. The local gradients, the restored weights and the first loss are exact.

`DDPBucketLayout` records the rebuilt layout when it is saved and, when it is loaded into a
new DDP, drives that DDP into the same layout before its first real step: one forward/backward
through DDP's own reducer on a synthetic zero loss that makes every parameter's gradient ready
in the recorded order, then the reducer's own one-time rebuild. Nothing else changes: no
random number is drawn, no data is read, weights, buffers and optimizer are untouched, and
every parameter's `.grad` is put back as it was. Declare it as a `custom` component::

    components:
      ddp: {kind: custom}      # global, json: one small record, the same on every rank

    ddp_model = DistributedDataParallel(model)
    CheckpointManager(spec, model=model, ..., ddp=DDPBucketLayout(ddp_model))

Loading it runs collectives (an all-reduce and a broadcast), so every rank must load it, as
every rank does in `mgr.load()`.
"""

from __future__ import annotations

import gc
from typing import Any

import torch
from torch import nn

from statereg.errors import CheckpointMismatchError, SpecError

_VERSION = 1


def _reducer_parameters(ddp: Any) -> list[nn.Parameter]:
    """The parameters in the order DDP's reducer indexes them.

    The same list as `DistributedDataParallel._build_params_for_reducer()` (modules in
    `named_modules()` order, their own trainable parameters, shared ones once, ignored ones
    left out), built here without that method's side effects.
    """
    ignored: set[str] = getattr(ddp, "parameters_to_ignore", set())
    seen: set[int] = set()
    params: list[nn.Parameter] = []
    for module_name, module in ddp.module.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            if not param.requires_grad or f"{module_name}.{param_name}" in ignored:
                continue
            if id(param) not in seen:
                seen.add(id(param))
                params.append(param)
    return params


def find_ddp(model: nn.Module) -> Any:
    """The DistributedDataParallel that wraps `model`, or None.

    `model` itself, a torch.compile wrapper around one, or the module a DDP was built
    around: a training loop often hands statereg the inner module and keeps the wrapper.
    That wrapper is found among the garbage collector's objects: one walk of the heap, done
    once by the caller, which keeps the answer.
    """
    seen = model
    while True:
        if isinstance(seen, nn.parallel.DistributedDataParallel):
            return seen
        inner = getattr(seen, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            break
        seen = inner
    ddp_type = nn.parallel.DistributedDataParallel
    return next((obj for obj in gc.get_objects()
                 if issubclass(type(obj), ddp_type) and obj.module is seen), None)


def _parse_indices(text: str) -> list[list[int]]:
    """DDP's logged per-bucket parameter indices, '5 4, 3 2, 1 0', as [[5, 4], [3, 2], [1, 0]]."""
    return [[int(i) for i in bucket.split()] for bucket in text.split(",") if bucket.strip()]


class DDPBucketLayout:
    """The bucket layout of one `DistributedDataParallel`, saved and restored as state.

    `state_dict()` reads the layout DDP reports about itself; `load_state_dict()` puts a newly
    constructed DDP into that layout before its first step, so the resumed run sums gradients
    across ranks in the same order as the uninterrupted one (module docstring). Construct it
    right after the DDP wrapper, before the first forward.
    """

    def __init__(self, ddp_model: nn.Module) -> None:
        if not isinstance(ddp_model, nn.parallel.DistributedDataParallel):
            raise SpecError(
                f"DDPBucketLayout needs the DistributedDataParallel wrapper itself, got a "
                f"{type(ddp_model).__name__}; pass the object DistributedDataParallel(model) "
                "returned (the model component takes the unwrapped module or the wrapper)"
            )
        if getattr(ddp_model, "_use_python_reducer", False):
            raise SpecError(
                "DDPBucketLayout: this DistributedDataParallel reduces gradients in Python "
                "(torch._dynamo.config.optimize_ddp = 'python_reducer'), "
                "which has no bucket layout to carry over; drop the ddp component, or use the "
                "default reducer"
            )
        self.ddp = ddp_model

    # -- what DDP tells about its buckets ---------------------------------------------------

    def _logging(self, refresh: bool) -> dict[str, Any]:
        # DDP's logger copies the reducer's bucket layout and gradient ready order into its
        # logging data at sampled iterations (every one of the first ten, then every 100th);
        # refreshing between iterations reads the reducer as it is now, and only resets
        # timing statistics.
        if refresh:
            logger = self.ddp.logger
            assert logger is not None  # DDP.__init__ sets it; Optional only in torch's annotation
            logger.set_runtime_stats_and_log()
        return dict(self.ddp._get_ddp_logging_data())

    def _never_rebuilds(self) -> bool:
        # The reducer rebuilds its buckets once, unless it looks for unused parameters in a
        # dynamic graph: then the initial layout is kept, and a new DDP already matches.
        return bool(self.ddp.find_unused_parameters) and not bool(self.ddp.static_graph)

    def state_dict(self) -> dict[str, Any]:
        """Where this DDP's reducer stands on its way to the rebuilt layout.

        `rebuilt_buckets`: the rebuilt buckets' parameter indices, once rebuilt. Before that,
        `iterations` (backward passes so far, which decide how far a new DDP must be driven)
        and `ready_order`, the gradient ready order the rebuild will use, once recorded.
        Nothing to restore when the buckets are never rebuilt (unused-parameter search in a
        dynamic graph keeps the initial layout, which a new DDP has too).
        """
        params = _reducer_parameters(self.ddp)
        state: dict[str, Any] = {"version": _VERSION, "num_params": len(params), "iterations": 0,
                                 "rebuilt_buckets": None, "ready_order": None}
        if self._never_rebuilds():
            return state
        data = self._logging(refresh=False)
        if not data.get("has_rebuilt_buckets"):
            # Not rebuilt as of the last sampled iteration; every one of the first ten is
            # sampled, so refreshing now reads the reducer as it is.
            data = self._logging(refresh=True)
        state["iterations"] = int(data.get("iteration", 0))
        if data.get("has_rebuilt_buckets"):
            state["rebuilt_buckets"] = _parse_indices(str(data["rebuilt_per_bucket_param_indices"]))
        elif data.get("prev_iteration_grad_ready_order_indices"):
            order = _parse_indices(str(data["prev_iteration_grad_ready_order_indices"]))
            state["ready_order"] = [i for bucket in order for i in bucket]
        return state

    # -- putting a new DDP into that layout ---------------------------------------------------

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Drive this (new) DDP as far as the saved one had gone towards its rebuilt layout."""
        if not isinstance(state, dict) or state.get("version") != _VERSION:
            raise CheckpointMismatchError(
                f"DDPBucketLayout: the checkpoint's ddp state is {state!r}, not a version "
                f"{_VERSION} layout record; it was written by another statereg version, load "
                "without this component (exclude it) to resume, not bit-exactly"
            )
        params = _reducer_parameters(self.ddp)
        if state["num_params"] != len(params):
            raise CheckpointMismatchError(
                f"DDPBucketLayout: the checkpoint's DDP had {state['num_params']} trainable "
                f"parameters, this one has {len(params)}; wrap the same model (same trainable "
                "parameters) in DDP, or exclude this component"
            )
        if self._never_rebuilds():
            return
        # The reducer records the ready order in its first backward (static_graph: in its
        # second, the first one only counts hooks), and rebuilds at the next forward.
        recording_pass = 2 if self.ddp.static_graph else 1
        if state["rebuilt_buckets"] is not None:
            order = [i for bucket in state["rebuilt_buckets"] for i in bucket]
            passes = recording_pass
        else:
            order = state["ready_order"] or list(reversed(range(len(params))))
            passes = min(int(state["iterations"]), recording_pass)
            if state["ready_order"] is None and passes >= recording_pass:
                raise CheckpointMismatchError(
                    f"DDPBucketLayout: the checkpoint records {state['iterations']} DDP "
                    "iterations but no gradient ready order; it was not written by this "
                    "component from a live DDP, exclude it"
                )
        if sorted(order) != list(range(len(params))):
            raise CheckpointMismatchError(
                f"DDPBucketLayout: the checkpoint's bucket layout {order} does not name each of "
                f"the {len(params)} parameters once; it belongs to another model, exclude this "
                "component"
            )
        for _ in range(passes):
            self._prime(params, order)
        if state["rebuilt_buckets"] is not None:
            self._rebuild_and_check(state["rebuilt_buckets"])

    def _prime(self, params: list[nn.Parameter], order: list[int]) -> None:
        """One DDP iteration whose gradients become ready in `order` (values discarded)."""
        ddp = self.ddp
        if not ddp.require_backward_grad_sync:
            raise SpecError("DDPBucketLayout: load_state_dict() was called inside "
                            "DistributedDataParallel.no_sync(); load outside it")
        saved_grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        with torch.enable_grad():
            ddp._pre_forward()
            # The autograd engine runs the last-built branch of a sum first (highest sequence
            # number), and a leaf's gradient accumulation as soon as it is ready; so building
            # the sum from the last parameter to the first makes order[0] ready first.
            loss = None
            for index in reversed(order):
                term = params[index].sum() * 0.0
                loss = term if loss is None else loss + term
            assert loss is not None
            loss = ddp._post_forward(loss)
            loss.backward()
        for p, grad in zip(params, saved_grads, strict=True):
            p.grad = grad

    def _rebuild_and_check(self, expected: list[list[int]]) -> None:
        """Run the reducer's one-time rebuild now, and check it produced the saved buckets."""
        ddp = self.ddp
        if ddp.reducer._rebuild_buckets():
            ddp._has_rebuilt_buckets = True
        got = self._logging(refresh=True).get("rebuilt_per_bucket_param_indices")
        if got is None or _parse_indices(str(got)) != expected:
            raise CheckpointMismatchError(
                f"DDPBucketLayout: the new DDP's gradient buckets are {got!r}, the checkpoint's "
                f"were {expected!r}; construct DistributedDataParallel with the same arguments "
                "(bucket_cap_mb, find_unused_parameters, static_graph) as the saved run, or "
                "exclude this component (the resume will then not be bit-exact under DDP)"
            )
