"""What ``partition(..., precision=...)`` asks: the dtype ops compute in, and the one gradients
are reduced in across dp.

``"fp32"``, ``"bf16"`` or ``"fp16"`` names the compute precision; gradients are then reduced in
fp32, as ``torch.autocast`` + DDP do. ``Precision(compute="bf16", reduce="bf16")`` halves the
bytes of the dp reduction as well (FSDP2's ``MixedPrecisionPolicy(reduce_dtype=...)``):
each rank's gradient is rounded to bf16, summed in bf16 and widened back to fp32 for the
optimizer. Parameters, their gradients and the optimizer's state stay in the model's own dtype
(fp32 master weights) whatever is chosen; ``passes.mixed_precision`` decides which ops run in
the low dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardfx.errors import InputError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Precision:
    compute: str = "fp32"  # fp32 | bf16 | fp16: the dtype matmul-class ops run in
    reduce: str = "fp32"  # fp32 | bf16 | fp16: the dtype gradients are summed in across dp

    def __post_init__(self) -> None:
        for field, value in (("compute", self.compute), ("reduce", self.reduce)):
            if value not in DTYPES:
                raise InputError(
                    f"unknown precision {value!r}", where=f"partition(..., precision=...) "
                    f"({field})", fix=f"use one of {', '.join(DTYPES)}, or "
                    "shardfx.Precision(compute='bf16', reduce='fp32')")

    @classmethod
    def parse(cls, value: "str | Precision | None") -> "Precision":
        if isinstance(value, Precision):
            return value
        if value is None:
            return cls()
        if not isinstance(value, str):
            raise InputError(f"precision must be a name or a shardfx.Precision, got "
                             f"{type(value).__name__} {value!r}",
                             where="partition(..., precision=...)",
                             fix=f"use one of {', '.join(DTYPES)}")
        return cls(compute=value.lower())

    @property
    def dtype(self) -> torch.dtype:
        """The dtype matmul-class ops compute in."""
        return DTYPES[self.compute]

    @property
    def narrower_reduce(self) -> torch.dtype | None:
        """The dtype dp sums gradients in where it is not fp32's; None: fp32."""
        return None if self.reduce == "fp32" else DTYPES[self.reduce]

    @property
    def low(self) -> bool:
        return self.compute != "fp32"

    @property
    def scales_loss(self) -> bool:
        """fp16 gradients underflow without a loss scale; bf16 has fp32's range."""
        return self.compute == "fp16"

    def __str__(self) -> str:
        return self.compute if self.reduce == "fp32" else \
            f"{self.compute}, gradients reduced in {self.reduce}"
