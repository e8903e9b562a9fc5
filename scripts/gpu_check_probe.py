"""Versions the GPU check reports, and whether torch sees a CUDA device.

Prints one `gpu_check_versions:` JSON line and one `gpu_check:` line of figures; with
--need-cuda it fails when torch sees no CUDA device (every later check would only skip);
with --no-device (the rehearsal) it reads installed versions only and never imports torch.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import sys


def version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--need-cuda", action="store_true", help="fail without a CUDA device")
    ap.add_argument("--no-device", action="store_true", help="versions only; no torch import")
    args = ap.parse_args()
    found = {
        "python": platform.python_version(),
        "torch": version("torch"),
        "triton": version("triton"),
        "cupy": version("cupy-cuda13x"),
        "vllm": version("vllm"),
    }
    if args.no_device:
        print("gpu_check_versions: " + json.dumps(found))
        print("gpu_check: versions read; no device queried (rehearsal)")
        return 0
    import torch

    found["torch"] += f" (CUDA {torch.version.cuda})"
    print("gpu_check_versions: " + json.dumps(found))
    cuda = torch.cuda.is_available()
    if cuda:
        props = torch.cuda.get_device_properties(0)
        print(
            f"gpu_check: torch sees {torch.cuda.device_count()} CUDA device(s), "
            f"{props.name}, {props.total_memory / 2**30:.0f} GiB, sm_{props.major}{props.minor}"
        )
    else:
        print("gpu_check: torch sees no CUDA device")
    if args.need_cuda and not cuda:
        print("no CUDA device visible to torch: every GPU check would only skip", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
