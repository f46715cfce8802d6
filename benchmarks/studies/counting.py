"""Device-independent cost counters for ``cost_counts.py``: FLOPs, peak live bytes and ATen operator calls of whatever
runs under them, and :class:`Shapes`, a mode under which full-size tensors cost nothing.

* :class:`OpCounter`: ATen operator calls (the kernel-launch proxy), by name.
* :class:`LiveBytes`: the peak of the bytes held by live storages that operators created (inputs made before the
  mode, such as the weights, are not counted; their gradients are).
* :class:`Shapes`: large tensors become :class:`Phantom` (a shape, a dtype and a meta storage, no data): every operator
  that touches one, or whose output is large, runs on the meta device, so its FLOPs and bytes are counted as the real
  operator's; small outputs computed from phantoms come back as real tensors filled with a constant (0.01, True, 0),
  so the trainer's data-dependent Python (``.item()``, ``if bad.any()``) still runs. The counts are exact for shapes;
  values are not computed, so anything that depends on them (a NaN branch) takes its finite path.

``FlopCounterMode`` (torch) counts FLOPs; enter :class:`Shapes` first and the counters after it, so that they see each
operator once with its real shapes.
"""

from __future__ import annotations

import weakref
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

BIG = 1 << 18  # elements from which an operator's output is a Phantom under Shapes
FILL = 0.01


def _storage_key(t: torch.Tensor):
    inner = t.meta if isinstance(t, Phantom) else t
    try:
        storage = inner.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None, 0
    return storage._cdata, storage.nbytes()


class Phantom(torch.Tensor):
    """A tensor with a shape, a dtype and a meta twin (``.meta``) but no data: only :class:`Shapes` computes with it."""

    @staticmethod
    def __new__(cls, meta: torch.Tensor, device: torch.device):
        return torch.Tensor._make_wrapper_subclass(
            cls, meta.shape, strides=meta.stride(), storage_offset=meta.storage_offset(), dtype=meta.dtype,
            device=device, requires_grad=meta.requires_grad)

    def __init__(self, meta: torch.Tensor, device: torch.device):
        self.meta = meta

    def __repr__(self, *, tensor_contents=None):
        return f"Phantom(shape={tuple(self.shape)}, dtype={self.dtype})"

    def data_ptr(self) -> int:
        """A stand-in for where its data would start: its meta storage's address plus its offset, distinct per
        storage and shared by its views and detached aliases, as real tensors' pointers are (else 0 for every phantom:
        code keyed on data pointers, such as ``factors._tensor_key`` grouping the layers that read one input, would
        take every same-shaped input of every layer for one tensor and count one Gram for them all)."""
        return self.meta.untyped_storage()._cdata + self.storage_offset() * self.element_size()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"Phantom tensors compute only under counting.Shapes (got {func}).")


def _filled(meta: torch.Tensor, device) -> torch.Tensor:
    value = True if meta.dtype == torch.bool else FILL if meta.dtype.is_floating_point or meta.dtype.is_complex else 0
    return torch.full(meta.shape, value, dtype=meta.dtype, device=device)


class Shapes(TorchDispatchMode):
    """Runs large work on the meta device (see the module's docstring). ``big``: the element count from which an
    output is a Phantom."""

    def __init__(self, device: str | torch.device = "cpu", big: int = BIG):
        super().__init__()
        self.device, self.big = torch.device(device), big

    def phantom(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as a Phantom (its meta twin), keeping ``requires_grad``."""
        meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        return Phantom(meta.requires_grad_(t.requires_grad), self.device)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self._call = (args, kwargs)
        flat, _ = tree_flatten((args, kwargs))
        has_phantom = any(isinstance(a, Phantom) for a in flat)
        if func is torch.ops.aten._local_scalar_dense.default and has_phantom:
            return _filled(args[0].meta, "cpu").item()
        if not has_phantom and not self._large_factory(func, args, kwargs) and not self._large_output(func, flat):
            return func(*args, **kwargs)
        if func in (torch.ops.aten.index.Tensor, torch.ops.aten.index_put_.default, torch.ops.aten.index_put.default):
            args = (args[0], _long_indices(args[1]), *args[2:])  # a real boolean mask: its positions, known here
        to_meta = lambda a: a.meta if isinstance(a, Phantom) else (  # noqa: E731
            a.to("meta") if isinstance(a, torch.Tensor) else a)
        meta_args, meta_kwargs = tree_map(to_meta, (args, kwargs))
        if "device" in meta_kwargs:
            meta_kwargs["device"] = torch.device("meta")
        out = func(*meta_args, **meta_kwargs)
        mutated = [a for a, s in zip(args, func._schema.arguments)
                   if s.alias_info is not None and s.alias_info.is_write]
        if mutated and isinstance(out, torch.Tensor) and mutated[0].shape == out.shape:
            return mutated[0]  # an in-place or out= operator: its target, untouched (values are not computed)
        return tree_map(lambda o: self._wrap(o) if isinstance(o, torch.Tensor) else o, out)

    def _large_factory(self, func, args, kwargs) -> bool:
        """A tensor-less operator (``zeros``, ``full``, ``empty``) with a large output: it runs on meta too."""
        if any(isinstance(a, torch.Tensor) for a in tree_flatten((args, kwargs))[0]):
            return False
        if kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "meta":
            return False
        shape = args[0] if args and isinstance(args[0], (list, tuple, torch.Size)) else None
        return shape is not None and all(isinstance(s, int) for s in shape) and _numel(shape) >= self.big

    def _large_output(self, func, flat) -> bool:
        """An operator on real tensors whose output is large all the same (a broadcast comparison): it runs on meta.
        Operators whose output size depends on values (``nonzero``) run for real."""
        if not any(isinstance(a, torch.Tensor) and a.numel() >= 256 for a in flat):
            return False
        args, kwargs = tree_map(lambda a: a.to("meta") if isinstance(a, torch.Tensor) else a, self._call)
        try:
            out = func(*args, **kwargs)
        except Exception:  # noqa: BLE001 - data-dependent operators have no meta form
            return False
        return any(isinstance(o, torch.Tensor) and o.numel() >= self.big for o in tree_flatten(out)[0])

    def _wrap(self, meta: torch.Tensor) -> torch.Tensor:
        if meta.numel() >= self.big:
            return Phantom(meta, self.device)
        return _filled(meta, self.device)


def _long_indices(indices) -> list:
    """Advanced indices with each real boolean mask replaced by the long indices of its true entries (the meta device
    cannot tell how many there are)."""
    out = []
    for idx in indices:
        if isinstance(idx, torch.Tensor) and not isinstance(idx, Phantom) and idx.dtype == torch.bool:
            out.extend(idx.nonzero().unbind(1))
        else:
            out.append(idx)
    return out


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class OpCounter(TorchDispatchMode):
    """ATen operator calls, by overload packet name (``aten.mm``); views and metadata queries included, as they are
    dispatched (each is a host-side call; on a GPU most launch a kernel). ``views``: how many of them were views (no
    kernel on any device)."""

    def __init__(self):
        super().__init__()
        self.calls: Counter = Counter()
        self.views = 0

    @property
    def total(self) -> int:
        return sum(self.calls.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[str(func.overloadpacket)] += 1
        self.views += bool(func.is_view)
        return func(*args, **(kwargs or {}))


class LiveBytes(TorchDispatchMode):
    """The peak of the bytes held by live storages that operators created under it. A storage is counted once
    (views share it), from the first operator output that holds it until every tensor seen holding it is freed; a view
    of a storage made before the mode (a weight's ``detach()`` or ``t()``) is not counted."""

    def __init__(self):
        super().__init__()
        self.live, self.peak = 0, 0
        self._holders: dict[int, list] = {}  # storage key -> [nbytes, number of live tensors seen holding it]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_storage_key(a)[0] for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)}
        if any(r.alias_info is not None for r in func._schema.returns) and not inputs & self._holders.keys():
            return out  # a view (or in-place result) of tensors made before the mode (under Shapes, of a meta copy)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t, inputs)
        return out

    def _track(self, t: torch.Tensor, inputs: set = frozenset()) -> None:
        key, nbytes = _storage_key(t)
        if key is None or (key in inputs and key not in self._holders):
            return  # a view of a tensor made before the mode (``weight.detach()``, ``weight.t()``): not an output
        entry = self._holders.get(key)
        if entry is None:
            entry = self._holders[key] = [nbytes, 0]
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        entry[1] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        entry = self._holders.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            del self._holders[key]


# Operators whose result the host must wait for on a GPU: a scalar read (``.item()``, ``bool(t)``, ``float(t)``) and
# those whose output size depends on values.
SYNC_OPS = {"aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.unique", "aten._unique",
            "aten._unique2", "aten.unique_dim", "aten.unique_consecutive", "aten.equal", "aten.nonzero_static"}


class HostSyncs(TorchDispatchMode):
    """Host syncs, counted on any device (issue 56): the operators of :data:`SYNC_OPS`, and every ``.tolist()``,
    ``.cpu()`` and ``.numpy()`` (each a device-to-host copy the host waits for on a GPU; on a CPU they dispatch
    nothing, so they are counted by wrapping the methods while the mode is on). ``calls``: by name."""

    METHODS = ("tolist", "cpu", "numpy")

    def __init__(self):
        super().__init__()
        self.calls: Counter = Counter()
        self._saved = {}

    @property
    def total(self) -> int:
        return sum(self.calls.values())

    def __enter__(self):
        for name in self.METHODS:
            original = self._saved[name] = getattr(torch.Tensor, name)

            def counted(t, *args, _name=name, _original=original, **kwargs):
                self.calls[f"Tensor.{_name}"] += 1
                return _original(t, *args, **kwargs)

            setattr(torch.Tensor, name, counted)
        return super().__enter__()

    def __exit__(self, *args):
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._saved.clear()
        return super().__exit__(*args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name in SYNC_OPS:
            self.calls[name] += 1
        return func(*args, **(kwargs or {}))
