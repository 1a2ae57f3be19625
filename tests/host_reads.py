"""Count host reads of tensors (what is a device-to-host sync on a GPU) while a window is open, on CPU.

A read is a Tensor method that hands a value to Python (`item`, `tolist`, `numpy`, `bool`/`int`/`float`/`index`),
seen by a TorchFunctionMode (on a CPU tensor `tolist` and `numpy` reach no dispatcher op), and the aten ops that
read the device or size their output by its values: `_local_scalar_dense` (what item/bool/int call inside),
`nonzero`, `is_nonzero`, `masked_select`, the `unique`s, `bincount`, `repeat_interleave` without `output_size`,
indexing by a boolean mask (a nonzero inside), seen by a TorchDispatchMode. Reads of tensors in `exempt` (host
buffers that never were on the device, e.g. sharding/expert_parallel/dispatch.py's token counts) are counted apart.

`windows(modules)` opens the window around each module's forward (hooks), so only reads inside them count.
`ops` counts the matrix multiplications run in the windows too (`_grouped_mm`, `mm`, `bmm`, ...): a Python loop over
experts shows as one `mm` per expert hit, a grouped one as one `_grouped_mm` per projection.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_METHODS = {torch.Tensor.item: "item", torch.Tensor.tolist: "tolist", torch.Tensor.numpy: "numpy",
            torch.Tensor.__bool__: "bool", torch.Tensor.__int__: "int", torch.Tensor.__float__: "float",
            torch.Tensor.__index__: "index"}
_aten = torch.ops.aten
_OPS = {_aten._local_scalar_dense.default: "_local_scalar_dense", _aten.nonzero.default: "nonzero",
        _aten.is_nonzero.default: "is_nonzero", _aten.masked_select.default: "masked_select",
        _aten._unique2.default: "unique", _aten.unique_consecutive.default: "unique",
        _aten.unique_dim.default: "unique", _aten.bincount.default: "bincount"}
_MATMULS = {_aten._grouped_mm.default: "_grouped_mm", _aten.mm.default: "mm", _aten.bmm.default: "bmm",
            _aten.addmm.default: "addmm", _aten.baddbmm.default: "baddbmm"}


class HostReads:
    def __init__(self, exempt=()):
        self.counts: Counter[str] = Counter()
        self.ops: Counter[str] = Counter()
        self.exempt_reads = 0
        self.exempt = list(exempt)
        self.open = 0  # > 0: inside a window
        self.in_method = False  # inside a counted Tensor method: its own _local_scalar_dense is not counted again

    def _count(self, kind: str, tensor=None) -> None:
        if not self.open:
            return
        if tensor is not None and any(tensor is t for t in self.exempt):
            self.exempt_reads += 1
        else:
            self.counts[kind] += 1

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @contextlib.contextmanager
    def window(self):
        self.open += 1
        try:
            yield
        finally:
            self.open -= 1

    @contextlib.contextmanager
    def windows(self, modules):
        """The window open during each of `modules`' forwards."""
        handles = []
        for module in modules:
            handles.append(module.register_forward_pre_hook(lambda *_: setattr(self, "open", self.open + 1)))
            handles.append(module.register_forward_hook(lambda *_: setattr(self, "open", self.open - 1)))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    @contextlib.contextmanager
    def counting(self):
        """Both modes on (reads are counted while a window is open)."""
        with _Functions(self), _Ops(self):
            yield


class _Functions(TorchFunctionMode):
    def __init__(self, reads: HostReads):
        super().__init__()
        self.reads = reads

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kind = _METHODS.get(func)
        if kind is None or self.reads.in_method:
            return func(*args, **(kwargs or {}))
        self.reads._count(kind, args[0] if args else None)
        self.reads.in_method = True
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.reads.in_method = False


class _Ops(TorchDispatchMode):
    def __init__(self, reads: HostReads):
        super().__init__()
        self.reads = reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _MATMULS and self.reads.open:
            self.reads.ops[_MATMULS[func]] += 1
        kind = _OPS.get(func)
        if func is _aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            kind = "repeat_interleave"
        elif func in (_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default) and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())):
            kind = "boolean index"
        if kind is not None and not (kind == "_local_scalar_dense" and self.reads.in_method):
            self.reads._count(kind, args[0] if kind == "_local_scalar_dense" else None)
        return func(*args, **kwargs)
