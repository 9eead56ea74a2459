"""LoRARequest: which adapter a request runs with (vLLM's class and field names)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """lora_name: the name requests use (the OpenAI `model` field, gRPC `lora_name`); lora_int_id: a positive id
    (vLLM's); lora_path: the PEFT adapter directory (models/loading/peft.py)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty string, got {self.lora_path!r}")

    @property
    def cache_key(self) -> tuple[str, str, int, str]:
        """What the prefix cache roots this adapter's block hashes in: two adapters never share KV."""
        return ("lora", self.lora_name, self.lora_int_id, self.lora_path)
