"""Install llmtrain's pinned dependencies except paddlepaddle (for GPU machines with paddlepaddle-gpu 3.x).

    python -m pip install paddlepaddle-gpu==3.3.1 -i https://www.paddlepaddle.org.cn/packages/stable/cu126/
    python -m pip install --no-deps -e . && python scripts/install_deps.py [--extras paddlenlp,dev]

Reads the pins from pyproject.toml, so the GPU install gets exactly the versions CI tests.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--extras", default="", help="comma-separated optional groups of pyproject.toml (paddlenlp, dev)")
    args = ap.parse_args()
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    reqs = list(project["dependencies"])
    for extra in filter(None, args.extras.split(",")):
        reqs += project["optional-dependencies"][extra]
    reqs = sorted({r for r in reqs if not r.replace("_", "-").lower().startswith("paddlepaddle")})
    print("installing:", " ".join(reqs))
    return subprocess.call([sys.executable, "-m", "pip", "install", *reqs])


if __name__ == "__main__":
    sys.exit(main())
