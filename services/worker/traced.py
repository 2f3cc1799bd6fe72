"""Transformer layers run as TorchScript graphs: one traced graph a layer and mask kind (ModelRunner traces
them at load; a kind not seen then is traced on first use).

Why: a 2-layer student's single sample is ~150 small aten calls, and between any two of them the compute
thread takes the GIL back from the worker's event loop. A traced layer runs as one call that holds no
GIL: about 12 % less compute alone and 20 % beside a thread busy in Python 30 % of the time (a 2-layer
student, one 25-token sample, one thread; `docs/benchmarks/scheduling.md`, "Traced layers"). The graphs
compute exactly what the
layer's own forward does; the module tree is untouched, so the worker's deadline hooks on the layers
still fire between layers. A call the graph does not cover runs the layer's own forward: gradients on,
arguments besides the hidden states, the attention mask and MPNet's relative-position bias, or a hook on a
layer's submodules that would act (tenant adapters hook the attention output projection, and act only in a
thread running a tenant batch).
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
    """What is traced: the layer's own forward on the inputs a call has (hidden; the mask; MPNet's bias)."""

    def __init__(self, layer: nn.Module, forward: LayerForward, masked: bool, biased: bool) -> None:
        super().__init__()
        self.layer = layer
        self.own_forward = forward
        self.masked, self.biased = masked, biased

    def forward(self, hidden: torch.Tensor, *inputs: torch.Tensor) -> Any:
        mask = inputs[0] if self.masked else None
        if not self.biased:
            return self.own_forward(hidden, mask)
        return self.own_forward(hidden, mask, inputs[-1])


def _position_bias(args: tuple, kwargs: dict[str, Any]) -> tuple[torch.Tensor | None, bool]:
    """(MPNet's relative-position bias, whether anything else a graph does not cover was passed): the bias
    comes third or by name; `output_attentions=False`, as MPNet's encoder passes it, changes nothing."""
    rest = dict(kwargs)
    bias = rest.pop("position_bias", None)
    if args:
        bias, args = args[0], args[1:]
    if rest.get("output_attentions") is False:
        del rest["output_attentions"]
    return bias, any(a is not None for a in (*args, *rest.values()))


class TracedLayer:
    """Replaces one layer's `forward`: the traced graph of its inputs' kind (mask: None, or dtype and rank;
    MPNet's bias or none)."""

    def __init__(self, layer: nn.Module) -> None:
        self.layer = layer
        self.own_forward: LayerForward = layer.forward
        self.graphs: dict[tuple | None, torch.jit.ScriptModule] = {}
        self._inner = [m for m in layer.modules() if m is not layer]
        self._tracing = threading.Lock()

    def __call__(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 *args: Any, **kwargs: Any) -> Any:
        bias, other = _position_bias(args, kwargs)
        if torch.is_grad_enabled() or other or self._hooked():
            return self.own_forward(hidden, attention_mask, *args, **kwargs)
        inputs = tuple(t for t in (attention_mask, bias) if t is not None)
        mask_kind = None if attention_mask is None else (attention_mask.dtype, attention_mask.dim())
        key = mask_kind if bias is None else (mask_kind, "bias")   # an unbiased key stays as before
        graph = self.graphs.get(key)
        if graph is None:
            with self._tracing:  # compute threads (student instances) meeting a new kind at once
                graph = self.graphs.get(key) or self._trace(hidden, attention_mask, bias)
                self.graphs[key] = graph
        return graph(hidden, *inputs)

    def _hooked(self) -> bool:
        """A hook inside the layer would act on this call. A hook may say it is idle now with an
        `inactive()` attribute (the tenant adapters' hooks, when this thread runs no tenant batch)."""
        return any(not getattr(hook, "inactive", _never)()
                   for m in self._inner for hook in (*m._forward_hooks.values(), *m._forward_pre_hooks.values()))

    def _trace(self, hidden: torch.Tensor, mask: torch.Tensor | None,
               bias: torch.Tensor | None) -> torch.jit.ScriptModule:
        example = tuple(t.clone() for t in (hidden, mask, bias) if t is not None)
        layer = _Layer(self.layer, self.own_forward, mask is not None, bias is not None).eval()
        with torch.inference_mode(False), torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", torch.jit.TracerWarning)  # shape reads recorded, not constants
            warnings.simplefilter("ignore", DeprecationWarning)       # TorchScript in torch 2.13: see the README
            traced = torch.jit.trace(layer, example, check_trace=False)
            return torch.jit.freeze(traced)


def trace_layers(encoder: nn.Module, layer_name: re.Pattern[str]) -> int:
    """Gives every layer of `encoder` whose name matches a TracedLayer forward; how many it gave."""
    layers = [m for name, m in encoder.named_modules() if layer_name.search(name)]
    for layer in layers:
        if not isinstance(layer.forward, TracedLayer):
            layer.forward = TracedLayer(layer)
    return len(layers)
