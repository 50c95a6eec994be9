"""The trainer's end of a weight-update group: new weights broadcast from the trainer's
process to troupe's workers (SGLang's ``init_weights_update_group`` and
``update_weights_from_distributed``, vLLM's RLHF example)."""

from typing import Any, Dict, Iterable, List, Tuple, Union

from . import _core

NamedTensors = Union[Dict[str, Any], Iterable[Tuple[str, Any]]]


def dtype_name(dtype: Any) -> str:
    """``"float32"`` for ``torch.float32``, ``numpy.float32`` or the string itself."""
    text = str(getattr(dtype, "name", dtype))
    return text[len("torch."):] if text.startswith("torch.") else text


def host_array(name: str, tensor: Any) -> Any:
    """A C-contiguous host array of ``tensor`` for the engine: PyTorch tensors detached
    (and made contiguous when they are not), NumPy arrays as they are when contiguous."""
    module = type(tensor).__module__
    if module.startswith("torch"):
        if tensor.device.type != "cpu":
            raise ValueError(f"tensor '{name}' is on {tensor.device}; give CPU tensors")
        return tensor.detach().contiguous()
    if module.startswith("numpy"):
        import numpy

        return numpy.ascontiguousarray(tensor)
    raise TypeError(f"tensor '{name}' is a {type(tensor).__name__} (a NumPy array or a PyTorch tensor)")


def describe(named_tensors: NamedTensors) -> Tuple[List[str], List[str], List[List[int]]]:
    """The names, dtypes and shapes that ``LLM.update_weights_from_distributed`` takes for
    these tensors."""
    items = list(named_tensors.items() if isinstance(named_tensors, dict) else named_tensors)
    return ([n for n, _ in items], [dtype_name(t.dtype) for _, t in items],
            [list(t.shape) for _, t in items])


def before_cuda() -> None:
    """Imports PyTorch, where it is installed, before troupe's CUDA module loads. Both need
    ``libnccl.so.2`` and a process keeps the first it loads: PyTorch's own import fails on
    the CUDA toolkit's older NCCL (a symbol it lacks), while troupe's module works on
    PyTorch's newer one."""
    try:
        import torch  # noqa: F401
    except ImportError:
        pass


def gpu_index(device: Any) -> int:
    """The GPU a ``WeightSender`` on NCCL uses: ``device`` as an index, ``"cuda:1"`` or a
    ``torch.device``; ``None`` is PyTorch's current GPU (0 without PyTorch)."""
    if device is None:
        try:
            import torch
        except ImportError:
            return 0
        return torch.cuda.current_device() if torch.cuda.is_available() else 0
    if isinstance(device, int):
        return device
    text = str(device)
    if text == "cuda":
        return gpu_index(None)
    if text.startswith("cuda:"):
        return int(text.partition(":")[2])
    raise ValueError(f"device {device!r} is no GPU (an index, 'cuda:N' or a torch.device)")


class WeightSender:
    """Member 0 of a weight-update group, in the trainer's process. The engine joins with
    ``LLM.init_weights_update_group(master_address, master_port, rank_offset=1,
    world_size=1 + tensor_parallel_size, backend=...)`` at the same time; both block until
    all members have come (or ``timeout`` seconds)::

        sender = WeightSender("127.0.0.1", 29500, world_size=3)   # trainer process
        llm.init_weights_update_group("127.0.0.1", 29500, 1, 3)   # engine process
        # each update: the engine calls update_weights_from_distributed(*describe(params))
        # while the trainer calls
        sender.send(model.named_parameters())

    ``send`` takes the tensors in the order the engine was told, PyTorch tensors or NumPy
    arrays (read in place); it raises ``TroupeError`` without sending when the engine
    refuses the update (the engine's own exception names the parameter). When ``send``
    itself cannot read a tensor it raises, and tells the engine, whose update raises too;
    the group stays usable either way.

    ``backend="gloo"`` (TCP) takes CPU tensors. ``backend="nccl"`` (the engine's workers on
    GPUs, one GPU per member) sends from GPU ``device`` (PyTorch's current one by default):
    CUDA tensors on it go as they are, after its current stream has finished them; CPU
    tensors pass through the GPU."""

    def __init__(self, master_address: str, master_port: int, world_size: int,
                 engine_rank_offset: int = 1, timeout: float = 60.0, backend: str = "gloo",
                 device: Any = None) -> None:
        self._gpu = 0
        if backend == "nccl":
            before_cuda()
            self._gpu = gpu_index(device)
        self._group = _core.WeightGroup(master_address, master_port, 0, world_size, timeout,
                                        backend, self._gpu)
        self._engine = engine_rank_offset
        self._nccl = backend == "nccl"

    def _prepared(self, name: str, tensor: Any) -> Any:
        if self._nccl and type(tensor).__module__.startswith("torch") and tensor.is_cuda:
            if tensor.device.index != self._gpu:
                raise ValueError(f"tensor '{name}' is on {tensor.device}; this sender's GPU "
                                 f"is cuda:{self._gpu}")
            return tensor.detach().contiguous()
        return host_array(name, tensor)

    def send(self, named_tensors: NamedTensors) -> None:
        try:
            items = list(named_tensors.items() if isinstance(named_tensors, dict)
                         else named_tensors)
            arrays = [(name, self._prepared(name, t)) for name, t in items]
            on_gpu = [getattr(a, "is_cuda", False) for _, a in arrays]
            if any(on_gpu):
                import torch

                # NCCL reads them on a stream of its own: what made them (and the copies
                # `contiguous` queued) must be done.
                torch.cuda.current_stream(self._gpu).synchronize()
        except BaseException:
            # The engine waits for the tensors: it hears that none come, and raises too.
            self._group.broadcast_flag(False, 0)
            raise
        self._group.broadcast_flag(True, 0)
        if not self._group.broadcast_flag(False, self._engine):
            error = _core.TroupeError("the engine refused the weight update (its exception "
                                      "names the parameter); nothing was sent")
            error.errc = "invalid_argument"
            raise error
        for (name, array), gpu in zip(arrays, on_gpu):
            if gpu:
                self._group.broadcast_gpu(array.data_ptr(), array.numel() * array.element_size(), 0)
            else:
                self._group.broadcast(name, array, 0)

    def close(self) -> None:
        """Leaves the group (the engine calls ``destroy_weights_update_group``)."""
        self._group = None

    def __enter__(self) -> "WeightSender":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
