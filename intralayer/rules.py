"""Input checks every module shares, each a ``ValueError`` that names the rule and the numbers.

- :func:`whole` and :func:`index`: a count must be a whole number, an index one of 0..size−1
  (``numbers.Integral``, never ``bool``).
- :func:`check_mesh`: the parallel degrees must divide the world size (callable before
  any process starts, like the modules' own rules: ``tensor_parallel.check_degrees``,
  ``sequence_parallel.check_sequence``, ``context_parallel.check_sequence`` and
  ``check_ulysses``, ``expert_parallel.check_placement``, ``planner.check_layout``, which
  calls it for a cluster's GPUs).
- :func:`check_shape`, :func:`check_tensor`, :func:`check_like` and :func:`check_group_device`: what the
  parallel modules and functions check on their inputs before any collective, so that a
  wrong shape, dtype or device is a message naming the argument, what was expected and
  what came, not a shape mismatch inside a matmul or a peer left waiting in a collective.
  They look only at metadata (type, shape, dtype, device): no data is read.
"""
from __future__ import annotations

import math
import numbers

import torch
import torch.distributed as dist


def _is_whole(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def whole(value, what: str, minimum: int = 1, unit: str = "") -> int:
    """``value`` as an int, or a ``ValueError`` naming ``what`` unless it is a whole number ≥ ``minimum``."""
    if not _is_whole(value) or value < minimum:
        raise ValueError(f"{what} must be a whole number{f' of {unit}' if unit else ''} ≥ {minimum}, got {value!r}")
    return int(value)


def index(value, what: str, size: int, among: str) -> int:
    """``value`` as an int, or a ``ValueError`` unless it is a whole number in 0..size−1.

    ``what`` is written just before the value (``"rank "``, ``"rank r="``), ``among`` names
    the ``size`` things it indexes (``"the P=4 ranks"``).
    """
    if not _is_whole(value) or not 0 <= value < size:
        raise ValueError(f"{what}{value!r} is not one of {among}: it must be one of 0..{size - 1}")
    return int(value)


# ---------------------------------------------------------------------------- the mesh

def check_dim(x: torch.Tensor, dim: int, who: str = "") -> int:
    """``dim`` as a non-negative index of one of ``x``'s dimensions (negative counts from the end)."""
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"{who + ': ' if who else ''}dim={dim} is out of range for a tensor with {x.dim()} dimensions")
    return dim % x.dim()


def check_mesh(world_size: int, exact: bool = False, world: str = "the world size", unit: str = "ranks",
               **degrees: int) -> int:
    """``ValueError`` unless the product of ``degrees`` (``tp=2, cp=2`` …) divides ``world_size``.

    Returns the degree left over for data parallelism, ``world_size / Π degrees``; with
    ``exact`` the product must be the world size itself (a mesh with no data parallelism).
    ``world`` and ``unit`` name the whole and its members in the messages (the planner's
    "the cluster's GPU count" and "GPUs").
    """
    world_size = whole(world_size, world)
    if not degrees:
        raise ValueError("check_mesh needs at least one degree, e.g. check_mesh(8, tp=2)")
    for name, value in degrees.items():
        whole(value, f"the degree {name}")
    product = math.prod(degrees.values())
    shape = " × ".join(f"{name}={value}" for name, value in degrees.items())
    if exact and product != world_size:
        raise ValueError(f"the mesh {shape} has {product} {unit} but {world} is {world_size}: "
                         f"launch {product} processes")
    if world_size % product:
        named = f"{'·'.join(degrees)} = {'·'.join(map(str, degrees.values()))} = " if len(degrees) > 1 else ""
        raise ValueError(f"the mesh {shape} ({named}{product} {unit}) does not divide {world} {world_size}")
    return world_size // product


# ---------------------------------------------------------------------------- tensors

def _dims_text(dims) -> str:
    dims = sorted(dims)
    if len(dims) == 1:
        return f"{dims[0]} dimension{'s' if dims[0] != 1 else ''}"
    return ", ".join(str(d) for d in dims[:-1]) + f" or {dims[-1]} dimensions"


def check_shape(x, last: int, who: str, dims: tuple[int, ...] = (3,)) -> None:
    """``ValueError`` naming ``who`` unless ``x`` is a floating tensor of ``dims`` dimensions ending in ``last``.

    The modules' own check on their input (``Block expects 3 dimensions with the last of size 16``).
    """
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{who} expects a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"{who} expects a floating-point tensor, got dtype {x.dtype}")
    if x.dim() not in dims or x.shape[-1] != last:
        want = " or ".join(f"{d} dimensions" for d in dims)
        raise ValueError(f"{who} expects {want} with the last of size {last}, got shape {tuple(x.shape)}")


def check_tensor(x, name: str, who: str, dims=None, last: int | None = None, floating: bool = True,
                 layout: str | None = None, min_dims: int | None = None, last_is: str | None = None) -> None:
    """``ValueError`` naming ``who`` and the argument ``name`` unless ``x`` is a tensor as expected.

    ``dims``: the allowed numbers of dimensions (an int or a tuple), or ``min_dims`` the
    fewest; ``layout`` describes them in the message, e.g. ``"(T, h)"``; ``last``: the
    size of the last dimension (``last_is`` says what it must match, e.g. ``"fc1's
    in_features"``); ``floating``: a floating-point dtype is required.
    """
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{who}: {name} must be a torch.Tensor, got {type(x).__name__}")
    if floating and not x.is_floating_point():
        raise ValueError(f"{who}: {name} must be a floating-point tensor, got dtype {x.dtype}")
    shape = tuple(x.shape)
    if dims is not None:
        allowed = (dims,) if isinstance(dims, int) else tuple(dims)
        if x.dim() not in allowed:
            laid = f" laid out {layout}" if layout else ""
            raise ValueError(f"{who}: {name} must have {_dims_text(allowed)}{laid}, got {x.dim()} "
                             f"(shape {shape})")
    if min_dims is not None and x.dim() < min_dims:
        laid = f" laid out {layout}" if layout else ""
        raise ValueError(f"{who}: {name} must have at least {min_dims} dimensions{laid}, got {x.dim()} "
                         f"(shape {shape})")
    if last is not None and (x.dim() == 0 or x.shape[-1] != last):
        why = f" ({last_is})" if last_is else ""
        raise ValueError(f"{who}: {name} must have a last dimension of size {last}{why}, got shape {shape}")


def check_like(x: torch.Tensor, name: str, ref: torch.Tensor, ref_name: str, who: str) -> None:
    """``ValueError`` unless ``x`` has ``ref``'s dtype and device (an input and the weights, say)."""
    if x.device != ref.device:
        raise ValueError(f"{who}: {name} is on {x.device} but {ref_name} is on {ref.device}; "
                         f"expected both on {ref.device}")
    if x.dtype != ref.dtype:
        raise ValueError(f"{who}: {name} has dtype {x.dtype} but {ref_name} has dtype {ref.dtype}; "
                         f"expected both {ref.dtype}")


#: the device types each backend communicates; a backend not listed is not checked.
BACKEND_DEVICES = {"gloo": ("cpu", "cuda"), "nccl": ("cuda",)}


def _group_devices(group) -> tuple[str, ...] | None:
    if not dist.is_initialized():
        return None                                    # the collective will say so itself
    backend = str(dist.get_backend(group))
    if ":" in backend:                                 # "cpu:gloo,cuda:nccl"
        return tuple(part.split(":")[0] for part in backend.split(","))
    return BACKEND_DEVICES.get(backend)


def check_group_device(x: torch.Tensor, name: str, who: str, group) -> None:
    """``ValueError`` unless the process group's backend can send ``x`` (gloo: CPU; NCCL: CUDA).

    A tensor on another device (or on ``meta``) would fail inside the collective on this
    rank only, while its peers wait for it until the timeout.
    """
    devices = _group_devices(group)
    if x.device.type == "meta" or (devices is not None and x.device.type not in devices):
        backend = dist.get_backend(group) if dist.is_initialized() else "no"
        want = " or ".join(devices) if devices else "a real device"
        raise ValueError(f"{who}: {name} is on {x.device}, but the {backend} process group sends tensors on "
                         f"{want}: move it there before calling")
