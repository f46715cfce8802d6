"""A wheel without the files a lent GPU's image does not load, so that it travels with the checkout (issue 56): the
bitsandbytes wheel (~41 MiB) holds one CUDA library per CUDA release and ROCm's; the image runs torch's CUDA 13.0,
which loads ``libbitsandbytes_cuda130.so``. The files matching ``--drop`` (glob patterns) leave the archive and its
``RECORD``, so pip installs it as any wheel.

    python benchmarks/slim_wheel.py .whl/bitsandbytes-*.whl --drop 'bitsandbytes/libbitsandbytes_cuda1[12]*' \\
        'bitsandbytes/libbitsandbytes_rocm*'
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import sys
import zipfile
from pathlib import Path


def slim(wheel: Path, drop: list[str]) -> tuple[int, int]:
    """Rewrite ``wheel`` in place without the members matching ``drop``; returns its sizes before and after."""
    before = wheel.stat().st_size
    gone = lambda name: any(fnmatch.fnmatch(name, pattern) for pattern in drop)  # noqa: E731
    tmp = wheel.with_suffix(".slim")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if gone(info.filename):
                continue
            data = src.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines()
                data = ("\n".join(line for line in lines if not gone(line.split(",", 1)[0])) + "\n").encode()
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    os.replace(tmp, wheel)
    return before, wheel.stat().st_size


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("wheels", nargs="+", type=Path)
    p.add_argument("--drop", nargs="+", required=True, help="glob patterns of the members to leave out")
    args = p.parse_args(argv)
    for wheel in args.wheels:
        before, after = slim(wheel, args.drop)
        print(f"{wheel.name}: {before / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
