"""The native build on every x86 CPU: the AMX tile-configuration fix (docs/native.md, "AMX"), a build keyed
by the CPU it was compiled for, and a test run that survives a native crash.

The AMX check needs no AMX hardware: it compiles ggml's AMX kernels (ggml-cpu/amx/mmq.cpp) for Sapphire
Rapids with the build machine's g++, and scripts/check_tilecfg.py replays the code before each `ldtilecfg` to
read the 64 bytes the instruction would load. On the pristine source GCC drops the stores of rows[]/colsb[];
on the patched one every byte equals the configuration the source assigns.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from clover_dev import REPO_ROOT, VENV_PYTHON

from scripts import check_tilecfg

from clover_native import cpu, loader

MMQ = Path("ggml/src/ggml-cpu/amx/mmq.cpp")
# What -DGGML_NATIVE=ON gives on a Sapphire Rapids machine, and the `sapphirerapids` variant of
# GGML_CPU_ALL_VARIANTS (portable builds: ggml/src/CMakeLists.txt, ggml_add_cpu_backend_variant).
FLAG_SETS = {
    "native-spr": ["-march=sapphirerapids"],
    "variant-spr": ["-msse4.2", "-mf16c", "-mfma", "-mbmi2", "-mavx", "-mavx2", "-mavx512f", "-mavx512cd",
                    "-mavx512vl", "-mavx512dq", "-mavx512bw", "-mavx512vbmi", "-mavx512vnni", "-mavx512bf16",
                    "-mamx-tile", "-mamx-int8"],
}


def _build_info() -> dict[str, str]:
    info = cpu.read_build_info(loader.lib_dir().parent)
    assert info, f"{loader.lib_dir().parent}/BUILD_INFO missing (make native writes it)"
    return info


def _trees() -> tuple[Path, Path]:
    """(pristine vendored tree, patched tree the native build compiled)."""
    info = _build_info()
    pristine = Path(info["sdist"]) / "vendor" / "llama.cpp"
    patched = Path(info["build_dir"]).parent / "src"
    for tree in (pristine, patched):
        assert (tree / MMQ).is_file(), f"{tree / MMQ} missing"
    return pristine, patched


def _compile(tree: Path, flags: list[str], out: Path) -> subprocess.Popen:
    cxx = os.environ.get("CXX", "g++")
    inc = [f"-I{tree / d}" for d in ("ggml/include", "ggml/src", "ggml/src/ggml-cpu")]
    cmd = [cxx, "-std=c++17", "-O3", "-DNDEBUG", "-fPIC", *flags, *inc, "-c", str(tree / MMQ), "-o", str(out)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _compile_all(jobs: dict[tuple[str, str], Path], out_dir: Path) -> None:
    """Compile each (tree, flag set), two compilers at a time (2 cores; about 1 GB each)."""
    items = list(jobs.items())
    for start in range(0, len(items), 2):
        procs = [_compile(tree, FLAG_SETS[flags], out_dir / f"{which}-{flags}.o")
                 for (which, flags), tree in items[start:start + 2]]
        for proc in procs:
            out, _ = proc.communicate(timeout=600)
            assert proc.returncode == 0, f"compiling mmq.cpp failed:\n{out[-3000:]}"


def _intrinsic_declares_8_bytes(cxx: str) -> bool:
    """True when the compiler's _tile_loadconfig names only a pointer-sized memory input (GCC 11-12): the
    pristine source must then fail the check."""
    header = subprocess.run([cxx, "-print-file-name=include/amxtileintrin.h"], capture_output=True,
                            text=True).stdout.strip()
    try:
        text = Path(header).read_text()
    except OSError:
        return False
    return '"m" (*((const void **)__config))' in text


@pytest.mark.native
def test_tilecfg_fix_in_compiled_amx_kernels(tmp_path: Path, record_property) -> None:
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        pytest.fail(f"{cxx} is needed to compile ggml's AMX kernels")
    pristine, patched = _trees()
    jobs = {("pristine", "native-spr"): pristine, ("patched", "native-spr"): patched,
            ("patched", "variant-spr"): patched}
    _compile_all(jobs, tmp_path)
    results = {}
    for (which, flags), tree in jobs.items():
        want = check_tilecfg.expected_config(tree / MMQ)
        n, failures = check_tilecfg.check(tmp_path / f"{which}-{flags}.o", want)
        assert n >= 1, f"{which}/{flags}: no ldtilecfg in the compiled AMX kernels (were the AMX flags applied?)"
        results[which, flags] = failures
    compiler = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    if _intrinsic_declares_8_bytes(cxx):  # the check can fail: today's source loses the configuration
        assert results["pristine", "native-spr"], "the pristine source passed the check: is the checker blind?"
        assert "rows[0]" in results["pristine", "native-spr"][0]
    for key in (("patched", "native-spr"), ("patched", "variant-spr")):
        assert not results[key], "\n".join(results[key])
    record_property("note", f"AMX tile config: the patched mmq.cpp passes ({', '.join(FLAG_SETS)}; {compiler})")


@pytest.mark.native
def test_tilecfg_in_the_built_library(record_property) -> None:
    """On a CPU with AMX, the -march=native build holds the AMX kernels: check the shipped library itself."""
    _build_info()
    lib = loader.lib_dir() / "libggml-cpu.so"
    assert lib.exists(), f"{lib} missing"
    _, patched = _trees()
    n, failures = check_tilecfg.check(lib.resolve(), check_tilecfg.expected_config(patched / MMQ))
    assert not failures, "\n".join(failures)
    if n == 0:
        assert not cpu.read_cpuinfo().has_amx, "this CPU has AMX but the native build holds no ldtilecfg"
        record_property("note", "AMX: this CPU has none, so the native build holds no AMX code to check "
                                f"({cpu.read_cpuinfo().summary()})")
    else:
        record_property("note", f"AMX: {n} ldtilecfg in {lib.name}, each reads the full configuration")


def test_checker_rejects_bad_input(tmp_path: Path) -> None:
    script = REPO_ROOT / "scripts" / "check_tilecfg.py"
    empty = tmp_path / "x.cpp"
    empty.write_text("int main() {}\n")
    done = subprocess.run([sys.executable, str(script), str(empty), "--source", str(empty)], capture_output=True,
                          text=True)
    assert done.returncode == 2
    assert "no `tc.palette_id" in done.stderr and "Traceback" not in done.stderr


# ------------------------------------------------------------------------------------------ CPU-keyed build
@pytest.mark.native
def test_build_info_records_the_cpu() -> None:
    info = _build_info()
    assert info.get("cpu_target"), "BUILD_INFO has no cpu_target"
    assert "cpu_features" in info
    here = cpu.read_cpuinfo()
    assert cpu.missing_features(info, here) == [], "the build uses features this CPU lacks"
    if "-DGGML_NATIVE=ON" in info.get("flags", "") and here.flags:
        assert set(cpu.build_features(info)) == set(here.ggml_features()), (info["cpu_features"], here.summary())



def test_a_limited_build_says_so_beside_the_cpu(tmp_path: Path) -> None:
    """Benchmarks name the ISA a GGML_NATIVE=OFF build was limited to: its figures are not the CPU's own."""
    base = "-DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_RPC=ON"
    limited = f"{base} -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_AVX512=OFF"
    assert cpu.build_isa({"flags": base}) is None
    assert cpu.build_isa({}) is None
    assert cpu.build_isa({"flags": "-DGGML_NATIVE=OFF"}) == []
    assert cpu.build_isa({"flags": "-DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON"}) is None
    assert cpu.build_isa({"flags": limited}) == ["AVX", "AVX2", "FMA"]
    assert cpu.build_isa({"flags": f"{limited} -DGGML_NATIVE=ON"}) is None, "the last GGML_NATIVE wins, as in CMake"
    (tmp_path / "BUILD_INFO").write_text(f"key=x\nflags={limited}\n")
    line = cpu.machine_summary(tmp_path)
    assert line.startswith(cpu.read_cpuinfo().summary())
    assert line.endswith("; build limited to AVX AVX2 FMA (GGML_NATIVE=OFF)"), line
    (tmp_path / "BUILD_INFO").write_text(f"key=x\nflags={base}\n")
    assert cpu.machine_summary(tmp_path) == cpu.read_cpuinfo().summary()

def _fake_cc(tmp_path: Path, march: str) -> Path:
    """A `cc` that answers the two questions build_native.sh asks about -march=native."""
    cc = tmp_path / f"cc-{march}"
    cc.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        case "$*" in
          *-dM*) echo '#define __AVX2__ 1'; [ {march} = sapphirerapids ] && echo '#define __AMX_TILE__ 1' ;;
          *) echo " /usr/lib/gcc/cc1 -E -quiet -v - -march={march} -mavx2 -mtune={march} -dumpbase -" >&2 ;;
        esac
        exit 0
        """))
    cc.chmod(0o755)
    return cc


def test_build_key_follows_the_cpu(tmp_path: Path) -> None:
    script = REPO_ROOT / "scripts" / "build_native.sh"

    def key(cc: Path, extra: str = "") -> dict[str, str]:
        env = {**os.environ, "CC": str(cc), "EXTRA_CMAKE_FLAGS": extra}
        done = subprocess.run(["bash", str(script), "--key"], capture_output=True, text=True, env=env, timeout=60)
        assert done.returncode == 0, done.stderr
        return dict(line.split("=", 1) for line in done.stdout.splitlines())

    zen = key(_fake_cc(tmp_path, "znver3"))
    spr = key(_fake_cc(tmp_path, "sapphirerapids"))
    assert zen["key"] == key(_fake_cc(tmp_path, "znver3"))["key"]
    assert zen["key"] != spr["key"], "two CPUs share one build key"
    assert spr["cpu_target"].startswith("-march=sapphirerapids") and "amx_tile" in spr["cpu_features"].split()
    assert "amx_tile" not in zen["cpu_features"].split()
    portable = key(_fake_cc(tmp_path, "sapphirerapids"), "-DGGML_NATIVE=OFF")
    assert portable["cpu_target"].startswith("portable")
    assert portable["key"] == key(_fake_cc(tmp_path, "znver3"), "-DGGML_NATIVE=OFF")["key"]


@pytest.mark.native
def test_build_for_another_cpu_is_refused(tmp_path: Path) -> None:
    """A build folder copied from a machine with more ISA extensions: a clear error, not SIGILL."""
    info = _build_info()
    lib = tmp_path / "native" / "lib"
    lib.mkdir(parents=True)
    for so in loader.lib_dir().iterdir():
        (lib / so.name).symlink_to(so.resolve())
    info["cpu_features"] = info.get("cpu_features", "") + " clover_test_feature"
    (tmp_path / "native" / "BUILD_INFO").write_text("".join(f"{k}={v}\n" for k, v in info.items()))
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_CPP_LIB_PATH"}
    env["CLOVER_NATIVE_LIB"] = str(lib)
    done = subprocess.run([str(VENV_PYTHON), "-m", "clover_cpp.cli", "generate", "-m", str(REPO_ROOT / "README.md"),
                           "-p", "x"], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "clover_test_feature" in done.stderr and "make native" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


# ------------------------------------------------------------------------------------------ crash isolation
def test_a_native_crash_fails_one_test_and_the_run_goes_on(tmp_path: Path) -> None:
    """With the project's pytest options, a test killed by SIGSEGV is reported as failed, the tests after it
    still run, and the run ends with a summary and a non-zero exit."""
    (tmp_path / "test_crash.py").write_text(textwrap.dedent(f"""\
        import os, signal

        def test_before():
            pass

        def test_segfault():
            os.kill(os.getpid(), signal.{signal.SIGSEGV.name})

        def test_after():
            pass
        """))
    done = subprocess.run([str(VENV_PYTHON), "-m", "pytest", "-c", str(REPO_ROOT / "pyproject.toml"),
                           "--rootdir", str(tmp_path), "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-3000:]
    assert "1 failed, 2 passed" in out, out[-3000:]
    assert "crashed" in out and "test_segfault" in out, out[-3000:]
