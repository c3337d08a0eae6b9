"""The CPU this process runs on: its ISA features, and the features the native build was compiled for.

``scripts/build_native.sh`` compiles with ``-march=native`` and records in ``build/native/BUILD_INFO`` which
ggml-relevant extensions that meant (``cpu_features=avx avx2 fma ...``, named as in /proc/cpuinfo).
``check_build`` refuses, with a message, to load a build whose features this CPU lacks; without it the first
AVX-512 instruction would kill the process with SIGILL.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# The extensions ggml's CPU backend uses, as /proc/cpuinfo spells them (the build script records these).
GGML_FEATURES = ("sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "avx_vnni", "avx512f", "avx512bw", "avx512vl",
                 "avx512dq", "avx512vbmi", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")

# ggml's CMake options for the ISA of a build without -march=native (ggml/CMakeLists.txt, "instruction set specific").
GGML_ISA_OPTIONS = ("SSE42", "AVX", "AVX_VNNI", "AVX2", "BMI2", "FMA", "F16C", "AVX512", "AVX512_VBMI", "AVX512_VNNI",
                    "AVX512_BF16", "AMX_TILE", "AMX_INT8", "AMX_BF16")

_CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True)
class CpuInfo:
    model: str
    flags: frozenset[str]

    @property
    def has_amx(self) -> bool:
        return "amx_int8" in self.flags and "amx_tile" in self.flags

    def ggml_features(self) -> list[str]:
        return [f for f in GGML_FEATURES if f in self.flags]

    def summary(self) -> str:
        """One line: model name and the ggml-relevant features (or what is missing of AVX-512 and AMX)."""
        feats = self.ggml_features()
        missing = [name for name, probe in (("avx512", "avx512f"), ("amx", "amx_int8")) if probe not in self.flags]
        tail = f" (no {', no '.join(missing)})" if missing else ""
        return f"{self.model or 'unknown CPU'}: {' '.join(feats) or 'no SIMD extensions known to ggml'}{tail}"


def read_cpuinfo(path: Path = _CPUINFO) -> CpuInfo:
    """Model name and flags of the first processor in /proc/cpuinfo (empty off Linux)."""
    model, flags = "", frozenset()
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return CpuInfo(model, flags)
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
        if model and flags:
            break
    return CpuInfo(model, flags)


def read_build_info(native_dir: Path) -> dict[str, str]:
    """build/native/BUILD_INFO as key=value pairs ({} when absent, e.g. a library from elsewhere)."""
    try:
        text = (native_dir / "BUILD_INFO").read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            out[key.strip()] = value.strip()
    return out


def build_features(info: dict[str, str]) -> list[str]:
    """The ISA features a native build was compiled for ([] for a portable build or an unknown one)."""
    value = info.get("cpu_features", "")
    if value.startswith("("):  # "(set by the CMake flags)": a portable build
        return []
    return value.split()


def _cmake_options(flags: list[str]) -> dict[str, bool]:
    """The -DGGML_<NAME>=<value> options among CMake flags, by NAME, each True when CMake reads its value as true
    (the last setting wins, as in CMake)."""
    out = {}
    for f in flags:
        if f.startswith("-DGGML_") and "=" in f:
            name, _, value = f.removeprefix("-DGGML_").partition("=")
            out[name.partition(":")[0]] = value.upper() in ("ON", "1", "TRUE", "YES", "Y")
    return out


def build_isa(info: dict[str, str]) -> list[str] | None:
    """The ggml ISA options a build without -march=native turned on (``-DGGML_NATIVE=OFF -DGGML_AVX2=ON ...`` in its
    CMake flags: ["AVX2", ...]; [] when it turned none on, so ggml's defaults apply); None for a native build, whose
    ISA is the machine's, a portable one (GGML_CPU_ALL_VARIANTS: ggml loads the machine's best variant), or an
    unknown one."""
    options = _cmake_options(info.get("flags", "").split())
    if options.get("NATIVE", True) or options.get("CPU_ALL_VARIANTS", False):
        return None
    return [name for name, on in options.items() if on and name in GGML_ISA_OPTIONS]


def machine_summary(native_dir: Path) -> str:
    """The CPU's one-line summary, and the ISA the build in native_dir was limited to when it was not compiled for
    this machine: a benchmark's figures belong to both."""
    line = read_cpuinfo().summary()
    isa = build_isa(read_build_info(native_dir))
    if isa is None:
        return line
    return f"{line}; build limited to {' '.join(isa) or 'ggml defaults'} (GGML_NATIVE=OFF)"


def missing_features(info: dict[str, str], cpu: CpuInfo | None = None) -> list[str]:
    """Features the build needs that this CPU lacks (nothing is checked when /proc/cpuinfo is unreadable)."""
    cpu = cpu or read_cpuinfo()
    if not cpu.flags:
        return []
    return [f for f in build_features(info) if f not in cpu.flags]


def check_build(native_dir: Path) -> None:
    """Raise RuntimeError when the build in native_dir was compiled for CPU features this CPU lacks."""
    info = read_build_info(native_dir)
    missing = missing_features(info)
    if missing:
        raise RuntimeError(
            f"{native_dir} was built with -march=native on a CPU with {' '.join(missing)}, which this CPU "
            f"({read_cpuinfo().model or 'unknown'}) lacks; running it would crash with SIGILL. Rebuild here "
            f"with `make native` (the build cache is keyed by CPU, so the other build is kept)")
