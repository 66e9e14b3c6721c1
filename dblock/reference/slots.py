"""`Slot`: where one tensor of a Hugging Face checkpoint lives in a dblock model.

Each family maps its HF names to slots once (`dblock.reference.llada_weights`, `dblock.reference.gemma_weights`);
`dblock.weights` reads that map three ways: the keys and shapes a folder must hold, where each streamed tensor goes
on load, and what to write on save. Config only: no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union


@dataclass(frozen=True)
class Slot:
    shape: tuple                          # the HF tensor's shape
    param: str                            # the model's state_dict name it fills
    index: Union[int, slice, None] = None  # expert j of a stacked (E, ...) param, a row range of a fused param,
                                          # or None: the whole param
    fp32: bool = False                    # stored and used in fp32 whatever the load dtype (LLaDA's expert bias)
    copy: bool = False                    # a second HF copy of the whole `param`: written on save, not loaded
    differs: Optional[str] = None         # copies only: must equal `param` on load, else a WeightsError ending so
