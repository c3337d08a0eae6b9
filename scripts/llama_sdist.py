#!/usr/bin/env python3
"""Fetch, verify and unpack the pinned llama-cpp-python sdist (stdlib only).

The download cache lives outside the clone: ${CLOVER_CACHE:-~/.cache/clover}/sdist/.
The expected sha256 is pinned in cpp_patch/SDIST_SHA256 ("<sha256>  <file name>").

    python3 scripts/llama_sdist.py unpack [--dest DIR]   # prints the unpacked path
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

PACKAGE = "llama-cpp-python"
VERSION = "0.3.36"
REPO_ROOT = Path(__file__).resolve().parent.parent
PIN_FILE = REPO_ROOT / "cpp_patch" / "SDIST_SHA256"
DEFAULT_DEST = REPO_ROOT / "build" / f"llama-cpp-python-{VERSION}"
MARKER = ".clover-sdist-sha256"


class HashMismatch(Exception):
    pass


def cache_dir() -> Path:
    base = os.environ.get("CLOVER_CACHE") or str(Path.home() / ".cache" / "clover")
    return Path(base) / "sdist"


def read_pin(pin_file: Path = PIN_FILE) -> tuple[str, str]:
    """Return (sha256, file name) from the one-line pin file."""
    sha, name = pin_file.read_text().split()
    return sha.lower(), name


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def pip_command() -> list[str]:
    """How to run pip with this interpreter. Inside pip's isolated build environment (`pip install .` runs
    setup.py's build hook there) the interpreter's own site-packages, where pip lives, are hidden, and
    ``python -m pip`` fails with "No module named pip"; ``-I`` (no PYTHON* variables, no user site) shows them
    again. PIP_* variables and pip.conf still apply, so the download uses the same index."""
    for flags in ([], ["-I"]):
        probe = subprocess.run([sys.executable, *flags, "-c", "import pip"], capture_output=True)
        if probe.returncode == 0:
            return [sys.executable, *flags, "-m", "pip"]
    raise SystemExit(f"error: {sys.executable} has no pip to download {PACKAGE}=={VERSION} with; "
                     f"put {PACKAGE}-{VERSION}.tar.gz into {cache_dir()} or install pip")


def download(cache: Path) -> None:
    cache.mkdir(parents=True, exist_ok=True)
    cmd = [*pip_command(), "download", "--no-binary", ":all:", "--no-deps", f"{PACKAGE}=={VERSION}", "-d", str(cache)]
    subprocess.run(cmd, check=True, stdout=sys.stderr)


def fetch(cache: Path, sha: str, name: str) -> Path:
    """Return the verified tarball, downloading it if it is not cached."""
    tarball = cache / name
    if not tarball.exists():
        download(cache)
    actual = sha256_of(tarball)
    if actual != sha:
        raise HashMismatch(f"sha256 mismatch for {tarball}: expected {sha}, got {actual}")
    return tarball


def is_unpacked(dest: Path, sha: str) -> bool:
    marker = dest / MARKER
    return marker.exists() and marker.read_text().strip() == sha


def unpack(tarball: Path, dest: Path, sha: str) -> Path:
    """Extract the sdist's single top-level folder as `dest` and write the marker."""
    if is_unpacked(dest, sha):
        return dest
    if dest.exists():
        shutil.rmtree(dest)
    staging = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    with tarfile.open(tarball) as tar:
        if hasattr(tarfile, "tar_filter"):  # Python >= 3.11.4 / 3.10.12
            tar.extractall(staging, filter="tar")
        else:
            tar.extractall(staging)
    (top,) = list(staging.iterdir())
    top.rename(dest)
    staging.rmdir()
    (dest / MARKER).write_text(sha + "\n")
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_unpack = sub.add_parser("unpack", help="fetch, verify and unpack; print the path")
    p_unpack.add_argument("--dest", type=Path, default=DEFAULT_DEST)
    sub.add_parser("fetch", help="fetch and verify only; print the tarball path")
    args = parser.parse_args(argv)

    sha, name = read_pin()
    try:
        if args.cmd == "unpack" and is_unpacked(args.dest.resolve(), sha):
            print(args.dest.resolve())
            return 0
        tarball = fetch(cache_dir(), sha, name)
    except HashMismatch as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.cmd == "fetch":
        print(tarball)
    else:
        print(unpack(tarball, args.dest.resolve(), sha))
    return 0


if __name__ == "__main__":
    sys.exit(main())
