"""What the node daemon does to its own process as it starts, in one place (issue 23: the daemon's
resident memory on a GPU node, 60 MB at most).

``PR_SET_THP_DISABLE``: measured on an H200, ``nvmlInit`` adds 18 MB to the process, most of it one
16 MB anonymous mapping that the driver's library allocates. The hypothesis this acts on: where the
kernel backs anonymous memory with transparent huge pages (``/sys/kernel/mm/transparent_hugepage/
enabled`` set to ``always``), a sparsely used mapping is made resident 2 MB at a time. The flag keeps
huge pages out of this process (and of the processes it starts: the MPS control daemons) and changes
nothing else. Whether it helps is for ``bench/nvml_memory.py`` to show on a GPU node: it runs NVML's
steps with and without the flag. Nothing here can measure it (no GPU, and THP is ``madvise`` here).
"""

from __future__ import annotations

import logging
import sys

log = logging.getLogger(__name__)

PR_SET_THP_DISABLE = 41  # linux/prctl.h


def disable_transparent_huge_pages() -> bool:
    """``prctl(PR_SET_THP_DISABLE, 1)`` for this process; whether the kernel took it (never raises)."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes  # loaded by pynvml on a GPU node in any case

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0) == 0:
            return True
        log.debug("PR_SET_THP_DISABLE refused: errno %d", ctypes.get_errno())
    except (OSError, AttributeError) as exc:
        log.debug("PR_SET_THP_DISABLE unavailable: %s", exc)
    return False


def prepare_process() -> None:
    """Everything above; the daemon calls it before it loads NVML (a topology file loads none)."""
    disable_transparent_huge_pages()
