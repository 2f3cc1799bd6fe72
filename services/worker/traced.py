"""Transformer layers run as TorchScript graphs: one traced graph a layer and mask kind (ModelRunner traces
them at load; a kind not seen then is traced on first use).

Why: a 2-layer student's single sample is ~150 small aten calls, and between any two of them the compute
thread takes the GIL back from the worker's event loop. A traced layer runs as one call that holds no
GIL: about 12 % less compute alone and 20 % beside a thread busy in Python 30 % of the time (a 2-layer
student, one 25-token sample, one thread; `docs/benchmarks/scheduling.md`, "Traced layers"). The graphs
compute exactly what the
layer's own forward does; the module tree is untouched, so the worker's deadline hooks on the layers
still fire between layers. A call the graph does not cover runs the layer's own forward: gradients on,
arguments besides the hidden states and the attention mask, or a hook on a layer's submodules that would
act (tenant adapters hook the teacher's attention output, and act only in a thread running a tenant batch).
"""

from __future__ import annotations

import re
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

LayerForward = Callable[..., torch.Tensor]


def _never() -> bool:
    return False


class _Layer(nn.Module):
    """What is traced: the layer's own forward on (hidden, mask), or on hidden alone for no mask."""

    def __init__(self, layer: nn.Module, forward: LayerForward) -> None:
        super().__init__()
        self.layer = layer
        self.own_forward = forward

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.own_forward(hidden, mask)


class TracedLayer:
    """Replaces one layer's `forward`: the traced graph of its mask kind (None, or dtype and rank)."""

    def __init__(self, layer: nn.Module) -> None:
        self.layer = layer
        self.own_forward: LayerForward = layer.forward
        self.graphs: dict[tuple | None, torch.jit.ScriptModule] = {}
        self._inner = [m for m in layer.modules() if m is not layer]
        self._tracing = threading.Lock()

    def __call__(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 *args: Any, **kwargs: Any) -> torch.Tensor:
        if torch.is_grad_enabled() or any(a is not None for a in (*args, *kwargs.values())) or self._hooked():
            return self.own_forward(hidden, attention_mask, *args, **kwargs)
        key = None if attention_mask is None else (attention_mask.dtype, attention_mask.dim())
        graph = self.graphs.get(key)
        if graph is None:
            with self._tracing:  # compute threads (student instances) meeting a new mask kind at once
                graph = self.graphs.get(key) or self._trace(hidden, attention_mask)
                self.graphs[key] = graph
        return graph(hidden) if attention_mask is None else graph(hidden, attention_mask)

    def _hooked(self) -> bool:
        """A hook inside the layer would act on this call. A hook may say it is idle now with an
        `inactive()` attribute (the tenant adapters' hooks, when this thread runs no tenant batch)."""
        return any(not getattr(hook, "inactive", _never)()
                   for m in self._inner for hook in (*m._forward_hooks.values(), *m._forward_pre_hooks.values()))

    def _trace(self, hidden: torch.Tensor, mask: torch.Tensor | None) -> torch.jit.ScriptModule:
        example = (hidden.clone(),) if mask is None else (hidden.clone(), mask.clone())
        with torch.inference_mode(False), torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", torch.jit.TracerWarning)  # shape reads recorded, not constants
            warnings.simplefilter("ignore", DeprecationWarning)       # TorchScript in torch 2.13: see the README
            traced = torch.jit.trace(_Layer(self.layer, self.own_forward).eval(), example, check_trace=False)
            return torch.jit.freeze(traced)


def trace_layers(encoder: nn.Module, layer_name: re.Pattern[str]) -> int:
    """Gives every layer of `encoder` whose name matches a TracedLayer forward; how many it gave."""
    layers = [m for name, m in encoder.named_modules() if layer_name.search(name)]
    for layer in layers:
        if not isinstance(layer.forward, TracedLayer):
            layer.forward = TracedLayer(layer)
    return len(layers)
