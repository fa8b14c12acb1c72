"""What the model identity of the disk KV cache costs at start-up: `Engine.load` with a disk cache, timed in fresh
processes, with the tensor digests' cache empty (a first start: every tensor hashed beside the load) and filled.

    python bench/identity_load.py MODEL.gguf --runs 7

Each run is a new process (imports not timed), the runs of the two kinds alternating so that the machine's load
affects both alike; the medians and minima are printed, and the time `compute_digests` alone takes. Run with
PYTHONPATH set to an older tree to time that tree's load (there the digest cache does not exist).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = """
import json, sys, tempfile, time
from pathlib import Path
from ds4_mlx.engine import Engine
try:
    from ds4_mlx.cache.kvstore import KvCacheOptions
except ImportError:  # a tree from before ds4_mlx/cache/ (the A/B against older commits)
    from ds4_mlx.kvstore import KvCacheOptions
with tempfile.TemporaryDirectory() as kv:
    t = time.perf_counter()
    Engine.load(Path(sys.argv[1]), 4096, kv_cache=KvCacheOptions(Path(kv)))
    print(json.dumps(time.perf_counter() - t))
"""

DIGEST_ONLY = """
import json, sys, time
from ds4_mlx.model.gguf import GGUFFile
try:
    from ds4_mlx.cache.tensordigest import compute_digests
except ImportError:  # a tree from before ds4_mlx/cache/
    from ds4_mlx.tensordigest import compute_digests
f = GGUFFile.open(sys.argv[1])
t = time.perf_counter()
compute_digests(f)
print(json.dumps(time.perf_counter() - t))
"""


def child(code: str, model: Path, digest_dir: str) -> float:
    env = {**os.environ, "DS4_MLX_DIGEST_DIR": digest_dir}
    out = subprocess.run([sys.executable, "-c", code, str(model)], env=env, capture_output=True, text=True,
                         check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path)
    p.add_argument("--runs", type=int, default=7)
    args = p.parse_args()
    cold, warm = [], []
    with tempfile.TemporaryDirectory() as cached:
        child(CHILD, args.model, cached)  # fills the cache (and the page cache)
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory() as empty:
                cold.append(child(CHILD, args.model, empty))
            warm.append(child(CHILD, args.model, cached))
        try:
            digest = child(DIGEST_ONLY, args.model, cached)
        except subprocess.CalledProcessError:
            digest = None  # an older tree without tensordigest.py
    result = {
        "model": str(args.model), "bytes": args.model.stat().st_size, "runs": args.runs,
        "load_empty_digest_cache_s": {"median": round(statistics.median(cold), 3), "min": round(min(cold), 3)},
        "load_filled_digest_cache_s": {"median": round(statistics.median(warm), 3), "min": round(min(warm), 3)},
        "compute_digests_alone_s": None if digest is None else round(digest, 3),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
