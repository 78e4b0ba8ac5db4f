"""A GPU's compute mode, named as ``nvidia-smi`` prints it, and NVML's numbers for each.

One spelling for the NVML backend, the fake backend, the stand-in MPS control and the node's strict share
enforcement (node/mps/compute_mode.py), so a mode read from one is understood by all.
"""

from __future__ import annotations

from typing import Final

DEFAULT: Final = "Default"
EXCLUSIVE_PROCESS: Final = "Exclusive_Process"
PROHIBITED: Final = "Prohibited"
MODES: Final = (DEFAULT, EXCLUSIVE_PROCESS, PROHIBITED)
# nvmlComputeMode_t: 1 (EXCLUSIVE_THREAD) has been gone since CUDA 8 and is shown as exclusive.
NVML_VALUES: Final = {DEFAULT: 0, PROHIBITED: 2, EXCLUSIVE_PROCESS: 3}
FROM_NVML: Final = {0: DEFAULT, 1: EXCLUSIVE_PROCESS, 2: PROHIBITED, 3: EXCLUSIVE_PROCESS}
