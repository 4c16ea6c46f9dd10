"""``python -m compile_report`` (with ``tests/`` on the path): `pretrain.train`, then one line on stdout saying
what `torch.compile` did in the process — ``[compile report] {"frames": …, "unique_graphs": …}`` from dynamo's
own counters — so a test can tell compiled blocks from a compile that silently ran nothing."""
from __future__ import annotations

import json

from torch._dynamo.utils import counters

from pretrain import train as entry

if __name__ == "__main__":
    try:
        entry.main()
    finally:
        report = {"frames": counters["frames"].get("ok", 0), "unique_graphs": counters["stats"].get("unique_graphs", 0),
                  "graph_breaks": sum(counters["graph_break"].values())}
        print("[compile report] " + json.dumps(report), flush=True)
