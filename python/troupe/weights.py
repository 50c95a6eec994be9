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


class WeightSender:
    """Member 0 of a weight-update group, in the trainer's process. The engine joins with
    ``LLM.init_weights_update_group(master_address, master_port, rank_offset=1,
    world_size=1 + tensor_parallel_size)`` at the same time; both block until all members
    have come (or ``timeout`` seconds)::

        sender = WeightSender("127.0.0.1", 29500, world_size=3)   # trainer process
        llm.init_weights_update_group("127.0.0.1", 29500, 1, 3)   # engine process
        # each update: the engine calls update_weights_from_distributed(*describe(params))
        # while the trainer calls
        sender.send(model.named_parameters())

    ``send`` takes the tensors in the order the engine was told, PyTorch CPU tensors or
    NumPy arrays (read in place); it raises ``TroupeError`` without sending when the engine
    refuses the update (the engine's own exception names the parameter)."""

    def __init__(self, master_address: str, master_port: int, world_size: int,
                 engine_rank_offset: int = 1, timeout: float = 60.0) -> None:
        self._group = _core.WeightGroup(master_address, master_port, 0, world_size, timeout)
        self._engine = engine_rank_offset

    def send(self, named_tensors: NamedTensors) -> None:
        items = list(named_tensors.items() if isinstance(named_tensors, dict) else named_tensors)
        arrays = [(name, host_array(name, t)) for name, t in items]
        if not self._group.broadcast_flag(False, self._engine):
            error = _core.TroupeError("the engine refused the weight update (its exception "
                                      "names the parameter); nothing was sent")
            error.errc = "invalid_argument"
            raise error
        for name, array in arrays:
            self._group.broadcast(name, array, 0)

    def close(self) -> None:
        """Leaves the group (the engine calls ``destroy_weights_update_group``)."""
        self._group = None

    def __enter__(self) -> "WeightSender":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
