"""vLLM's ``LoRARequest``."""

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT LoRA adapter (a directory with ``adapter_config.json`` and
    ``adapter_model.safetensors``), named by a positive integer id."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id <= 0:
            raise ValueError(f"lora_int_id must be a positive integer, not {self.lora_int_id!r}")
