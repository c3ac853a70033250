"""Why the MoE twin's dropless rows load their busiest expert 2-5x the mean: its routing at initialisation, on CPU.

    python benchmarks/moe_init_routing.py --out benchmarks/data/moe_init_routing/routing.json    # PyTorch (CPU)

For the held-out dropless shapes at micro-batch 1 (gpu_h100.moe_rows), one forward of the twin (fp32, CPU, the
row's seed on a CPU generator: the same distributions as the GPU rows, not the same numbers) with the router as
initialised (`init`) and with its logits replaced by i.i.d. N(0, 1) draws per token (`balanced`,
gpu_moe_launches.Balanced): per MoE layer the busiest expert's load over the mean T k / E (`layer_factors`, the C a
dropless dispatcher reads) and the share of the router input's energy in one component common to every token
(`shared_share`: |mean_t x_t|^2 / mean_t |x_t|^2). A forward takes 4-9 minutes on this 2-core host.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import zlib

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_h100  # noqa: E402
import gpu_moe  # noqa: E402
from gpu_model import make_batch  # noqa: E402
from gpu_moe_launches import Balanced  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cpu, out = torch.device("cpu"), []
    rows = {k: v for k, v in gpu_h100.moe_rows(False).items() if v[1].capacity_factor == 0 and "-mb1-" in k}
    for name, (a, m, mb, _n) in rows.items():
        for router in ("init", "balanced"):
            t0 = time.time()
            g = torch.Generator()
            g.manual_seed(zlib.crc32(name.rsplit("-", 2)[0].encode()))
            gpu_moe.CAPACITIES.clear()
            model = Balanced(a, m, cpu, torch.float32, generator=g, balanced=router == "balanced")
            batch = make_batch(a, mb, cpu, g)
            with torch.no_grad():
                model(*batch)
            mean = mb * a.seq * m.top_k / m.experts
            out.append({"name": name, "router": router, "layer_factors": [c / mean for c in gpu_moe.CAPACITIES],
                        "shared_share": [float(s) for s in model.shares], "seconds": time.time() - t0})
            print(json.dumps(out[-1]), flush=True)
            with open(args.out, "w") as f:
                json.dump({"torch": torch.__version__, "notes": __doc__, "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
