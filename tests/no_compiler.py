"""``python -m no_compiler`` (with ``tests/`` on the path): `pretrain.train` on a machine where torch.compile finds
no C++ compiler, as a slim container without gcc is (Inductor's CPU compiler is a path that does not exist;
DeepSpeed's own op builds keep the real one). Run it with an empty ``TORCHINDUCTOR_CACHE_DIR``: a cached kernel
needs no compiler."""
from __future__ import annotations

import torch._inductor.config as inductor_config

from pretrain import train as entry

MISSING_COMPILER = "/nonexistent/g++"
inductor_config.cpp.cxx = (None, MISSING_COMPILER)

if __name__ == "__main__":
    entry.main()
