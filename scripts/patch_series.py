#!/usr/bin/env python3
"""Maintain cpp_patch/patches/, the series of patches applied to the vendored llama.cpp (stdlib, git, GNU patch).

    scripts/patch_series.py materialize [--dir DIR]   # DIR/pristine and DIR/patched (a git repository)
    scripts/patch_series.py regenerate  [--dir DIR]   # rewrite cpp_patch/patches/ from DIR/patched's commits
    scripts/patch_series.py check                     # the series applies in order; the standalone ones alone

DIR defaults to build/patch-series. ``materialize`` copies the pinned sdist's vendor/llama.cpp to DIR/pristine
and again to DIR/patched, where it commits the pristine tree (tag ``pristine``) and then each patch as one
commit, in order, with the patch's header as the commit message. Edit the patches as commits there (docs/native.md,
"Changing a patch"), then ``regenerate`` writes one patch file per commit after ``pristine``: the commit message,
a blank line and ``git diff`` of the commit. The file name is NNNN (the commit's place) and the message's
``Patch-name:`` trailer. The overlay (cpp_patch/src, cpp_patch/tools) is not part of the series.

A header ends with trailers: ``Patch-name: <short-name>`` and, for a patch that applies to the pristine tree by
itself (an upstream candidate), ``Standalone: yes``. ``check`` applies the series in order to a copy of the files
it touches (``patch --dry-run`` first, naming the patch that fails) and each standalone patch alone to the
pristine tree; tests/native/test_patch_series.py runs it.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
SERIES_DIR = REPO_ROOT / "cpp_patch" / "patches"
DEFAULT_DIR = REPO_ROOT / "build" / "patch-series"
PATCH_NAME = re.compile(r"^(\d{4})-([a-z0-9][a-z0-9-]*)\.patch$")
# commits made here must not depend on the user's git configuration (hooks, signing, diff settings)
GIT_ENV = {"GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_SYSTEM": os.devnull, "GIT_AUTHOR_NAME": "clover",
           "GIT_AUTHOR_EMAIL": "clover@localhost", "GIT_COMMITTER_NAME": "clover",
           "GIT_COMMITTER_EMAIL": "clover@localhost"}


class SeriesError(Exception):
    pass


def series() -> list[Path]:
    """The patch files in the order the build applies them."""
    paths = sorted(SERIES_DIR.glob("*.patch"))
    for p in paths:
        if not PATCH_NAME.match(p.name):
            raise SeriesError(f"{p}: patch names are NNNN-short-name.patch")
    return paths


def split_patch(text: str) -> tuple[str, str]:
    """(header, diff) of a patch file: the diff starts at its first 'diff ' line."""
    m = re.search(r"^diff ", text, re.M)
    if not m:
        raise SeriesError("no 'diff ' line")
    return text[:m.start()], text[m.start():]


def trailers(header: str) -> dict[str, str]:
    return {m[1].lower(): m[2].strip() for m in re.finditer(r"^([A-Za-z-]+): (.+)$", header, re.M)}


def touched_files(diff: str) -> list[str]:
    """Paths (relative to the tree) a diff writes, from its '+++ b/...' lines."""
    return [m[1] for m in re.finditer(r"^\+\+\+ b/(\S+)", diff, re.M)]


def pristine_tree() -> Path:
    """vendor/llama.cpp of the pinned sdist (unpacked by scripts/llama_sdist.py when needed)."""
    out = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "llama_sdist.py"), "unpack"],
                         check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
    return Path(out) / "vendor" / "llama.cpp"


def apply(patch: Path, tree: Path, dry_run: bool) -> None:
    args = ["patch", "-p1", "--forward", "--fuzz=0", "--no-backup-if-mismatch", "--quiet", "-d", str(tree),
            "-i", str(patch)]
    proc = subprocess.run(args + (["--dry-run"] if dry_run else []), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SeriesError(f"{patch.name} does not apply to {tree}:\n{proc.stdout}{proc.stderr}")


def git(tree: Path, *args: str, capture: bool = False, stdin: str | None = None) -> str:
    proc = subprocess.run(["git", "-C", str(tree), *args], env={**os.environ, **GIT_ENV}, check=True,
                          capture_output=capture, text=True, input=stdin)
    return proc.stdout if capture else ""


def materialize(work: Path) -> None:
    pristine, patched = work / "pristine", work / "patched"
    for d in (pristine, patched):
        if d.exists():
            raise SeriesError(f"{d} exists: remove {work} first (regenerate what you changed before)")
    src = pristine_tree()
    work.mkdir(parents=True, exist_ok=True)
    # the sdist keeps llama.cpp's submodule link (a .git file naming a folder that is not there)
    no_git = shutil.ignore_patterns(".git")
    shutil.copytree(src, pristine, symlinks=True, ignore=no_git)
    shutil.copytree(src, patched, symlinks=True, ignore=no_git)
    git(patched, "init", "-q")
    git(patched, "add", "-A", "-f")  # -f: the vendored .gitignore must not hide files of the tree
    git(patched, "commit", "-q", "-m", "pristine vendor/llama.cpp of the pinned llama-cpp-python sdist")
    git(patched, "tag", "pristine")
    for p in series():
        header, _ = split_patch(p.read_text())
        apply(p, patched, dry_run=False)
        git(patched, "add", "-A", "-f")
        git(patched, "commit", "-q", "--cleanup=verbatim", "-F", "-", stdin=header.rstrip("\n") + "\n")
    print(f"{pristine}\n{patched}: {len(series())} commits on tag 'pristine'")


def regenerate(work: Path) -> None:
    patched = work / "patched"
    if git(patched, "status", "--porcelain", "--untracked-files=all", capture=True).strip():
        raise SeriesError(f"{patched} has uncommitted changes: commit them into the patch they belong to "
                          "(git commit --fixup=<commit>; git rebase -i --autosquash pristine)")
    commits = git(patched, "rev-list", "--reverse", "pristine..HEAD", capture=True).split()
    files: dict[str, str] = {}
    for i, c in enumerate(commits, 1):
        message = git(patched, "log", "-1", "--format=%B", c, capture=True).rstrip("\n") + "\n"
        name = trailers(message).get("patch-name")
        if not name or not re.fullmatch(r"[a-z0-9][a-z0-9-]*", name):
            raise SeriesError(f"commit {c[:12]} ({message.splitlines()[0]}) needs a 'Patch-name: short-name' trailer")
        diff = git(patched, "diff", "--no-color", "--no-ext-diff", "--no-renames", "-U3", "--src-prefix=a/",
                   "--dst-prefix=b/", f"{c}~1", c, capture=True)
        if not diff:
            raise SeriesError(f"commit {c[:12]} ({name}) changes nothing")
        files[f"{i:04d}-{name}.patch"] = message + "\n" + diff
    for old in SERIES_DIR.glob("*.patch"):
        if old.name not in files:
            old.unlink()
    SERIES_DIR.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (SERIES_DIR / name).write_text(text)
    print("\n".join(f"cpp_patch/patches/{n}" for n in files))
    check()


def check(pristine: Path | None = None, built: Path | None = None) -> list[str]:
    """The series applies in order to the pristine tree, and each 'Standalone: yes' patch applies to it alone.
    With ``built`` (a tree scripts/build_native.sh prepared), every file the series touches must equal the series'
    result there. Returns the touched paths."""
    pristine = pristine or pristine_tree()
    patches = series()
    if not patches:
        raise SeriesError(f"no patches in {SERIES_DIR}")
    touched: set[str] = set()
    for p in patches:
        header, diff = split_patch(p.read_text())
        if not header.strip() or "patch-name" not in trailers(header):
            raise SeriesError(f"{p.name}: the header (subject, why, what, how it was tested, trailers) is missing")
        touched.update(touched_files(diff))
        if trailers(header).get("standalone") == "yes":
            apply(p, pristine, dry_run=True)
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp)
        for rel in touched:  # a copy of the files the series changes is enough to apply it
            if (pristine / rel).exists():
                (tree / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(pristine / rel, tree / rel)
        for p in patches:
            apply(p, tree, dry_run=True)
            apply(p, tree, dry_run=False)
        differ = [rel for rel in sorted(touched)
                  if built is not None and (tree / rel).read_bytes() != (built / rel).read_bytes()]
        if differ:
            raise SeriesError(f"{built} is not the pristine tree plus the series: {', '.join(differ)} differ")
    print(f"patch_series: {len(patches)} patches apply in order; standalone ones apply alone")
    return sorted(touched)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=("materialize", "regenerate", "check"))
    ap.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="work folder (default build/patch-series)")
    args = ap.parse_args()
    try:
        if args.command == "materialize":
            materialize(args.dir)
        elif args.command == "regenerate":
            regenerate(args.dir)
        else:
            check()
    except (SeriesError, subprocess.CalledProcessError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
