#!/usr/bin/env python3
"""Check that every AMX `ldtilecfg` in an x86-64 object or library reads a fully written tile configuration.

    python3 scripts/check_tilecfg.py build/native/lib/libggml-cpu.so --source <tree>/ggml/src/ggml-cpu/amx/mmq.cpp
    python3 scripts/check_tilecfg.py mmq.o --source mmq.cpp

`ldtilecfg m512` loads a 64-byte configuration (palette, start row, 16 x colsb, 16 x rows). GCC's
`_tile_loadconfig` (amxtileintrin.h, GCC 11-12) names only 8 bytes of it as the asm's memory input, so the
compiler may drop the stores of the other fields as dead; the CPU then reads stack garbage and raises #GP
(SIGSEGV) on machines with AMX. docs/native.md has the story.

For each `ldtilecfg disp(%base)` this replays the straight-line code of its basic block (from the last
branch, call or jump target before it) over a symbolic stack: immediate and register stores, zeroing idioms,
and constant loads from .rodata (resolved through relocations in an object file, or through the address
objdump prints in a linked library). Anything it cannot follow makes the bytes it may touch unknown, so the
check can only err towards failing. The 64 bytes read by the instruction must all be known and equal the
configuration that the source assigns (`tc.palette_id`, `tc.rows[i]`, `tc.colsb[i]`), parsed with --source.

Exit status: 0 when every ldtilecfg passes (or there is none), 1 with one line per failure, 2 on bad input.
Needs binutils' objdump; no AMX hardware.
"""

from __future__ import annotations

import argparse
import re
import struct
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

CONFIG_BYTES = 64

GPR64 = ["rax", "rbx", "rcx", "rdx", "rsi", "rdi", "rbp", "rsp"] + [f"r{i}" for i in range(8, 16)]
_GPR_ALIASES: dict[str, tuple[str, int]] = {}
for _full, _e, _w, _b in zip(GPR64[:8], ["eax", "ebx", "ecx", "edx", "esi", "edi", "ebp", "esp"],
                             ["ax", "bx", "cx", "dx", "si", "di", "bp", "sp"],
                             ["al", "bl", "cl", "dl", "sil", "dil", "bpl", "spl"]):
    _GPR_ALIASES.update({_full: (_full, 8), _e: (_full, 4), _w: (_full, 2), _b: (_full, 1)})
for _i in range(8, 16):
    _GPR_ALIASES.update({f"r{_i}": (f"r{_i}", 8), f"r{_i}d": (f"r{_i}", 4), f"r{_i}w": (f"r{_i}", 2),
                         f"r{_i}b": (f"r{_i}", 1)})
_VEC = re.compile(r"%([xyz])mm(\d+)$")
_VEC_WIDTH = {"x": 16, "y": 32, "z": 64}
_MEM = re.compile(r"^(-?0x[0-9a-f]+|-?\d+)?\((%\w+)?(?:,(%\w+)(?:,(\d))?)?\)$")
_SUFFIX_WIDTH = {"b": 1, "w": 2, "l": 4, "q": 8}
_ZERO_IDIOMS = {"pxor", "vpxor", "vpxord", "vpxorq", "xorps", "vxorps", "xorpd", "vxorpd"}
_VEC_MOVES = {"movaps", "movups", "movapd", "movupd", "movdqa", "movdqu", "vmovaps", "vmovups", "vmovapd", "vmovupd",
              "vmovdqa", "vmovdqu", "vmovdqa32", "vmovdqa64", "vmovdqu8", "vmovdqu16", "vmovdqu32", "vmovdqu64"}
_CONTROL = re.compile(r"^(j[a-z]+|call[a-z]*|ret[a-z]*|loop[a-z]*|jmp[a-z]*|ud2|hlt|int3)$")


class BadInput(Exception):
    """The file or the source cannot be checked (exit 2)."""


# ---------------------------------------------------------------------------------------------- ELF reading
@dataclass
class Section:
    name: str
    addr: int
    offset: int
    size: int
    kind: int


class Elf:
    """Just enough of ELF64 little-endian: sections, symbols, and bytes by address or symbol."""

    def __init__(self, path: Path) -> None:
        self.data = path.read_bytes()
        if self.data[:4] != b"\x7fELF" or self.data[4] != 2 or self.data[5] != 1:
            raise BadInput(f"{path}: not a 64-bit little-endian ELF file")
        shoff, = struct.unpack_from("<Q", self.data, 0x28)
        shentsize, shnum, shstrndx = struct.unpack_from("<HHH", self.data, 0x3A)
        raw = [struct.unpack_from("<IIQQQQIIQQ", self.data, shoff + i * shentsize) for i in range(shnum)]
        names = raw[shstrndx]
        self.sections = [Section(self._str(names[4], s[0]), s[3], s[4], s[5], s[1]) for s in raw]
        self.symbols: dict[str, tuple[int, int]] = {}  # name -> (section index, value)
        for s in raw:
            if s[1] != 2:  # SHT_SYMTAB
                continue
            strtab = raw[s[6]][4]
            for off in range(s[4], s[4] + s[5], 24):
                st_name, _info, _other, shndx, value, _size = struct.unpack_from("<IBBHQQ", self.data, off)
                name = self._str(strtab, st_name)
                if name and name not in self.symbols:
                    self.symbols[name] = (shndx, value)

    def _str(self, table_offset: int, index: int) -> str:
        start = table_offset + index
        return self.data[start:self.data.index(b"\0", start)].decode("utf-8", "replace")

    def bytes_at_symbol(self, name: str, addend: int, n: int) -> bytes | None:
        if name in (s.name for s in self.sections):  # a section symbol, as in `.rodata.cst16+0x10`
            sec = next(s for s in self.sections if s.name == name)
            return self._section_bytes(sec, addend, n)
        if name not in self.symbols:
            return None
        shndx, value = self.symbols[name]
        if not 0 < shndx < len(self.sections):
            return None
        return self._section_bytes(self.sections[shndx], value + addend, n)

    def bytes_at_address(self, addr: int, n: int) -> bytes | None:
        for sec in self.sections:
            if sec.addr and sec.addr <= addr and addr + n <= sec.addr + sec.size:
                return self._section_bytes(sec, addr - sec.addr, n)
        return None

    def _section_bytes(self, sec: Section, off: int, n: int) -> bytes | None:
        if sec.kind == 8 or off < 0 or off + n > sec.size:  # SHT_NOBITS holds no file bytes
            return None
        return self.data[sec.offset + off: sec.offset + off + n]


# ---------------------------------------------------------------------------------------------- disassembly
@dataclass
class Insn:
    addr: int
    mnemonic: str
    operands: list[str]
    comment: str = ""
    reloc: tuple[str, int] | None = None  # (symbol, addend) of an R_X86_64_PC32-style relocation
    reloc_at: int = 0
    length: int = 0


@dataclass
class Function:
    name: str
    insns: list[Insn] = field(default_factory=list)


def split_operands(text: str) -> list[str]:
    """AT&T operands, split on commas outside parentheses."""
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


_FUNC = re.compile(r"^([0-9a-f]+) <(.+)>:$")
_INSN = re.compile(r"^\s*([0-9a-f]+):\t(.*)$")
_RELOC = re.compile(r"([0-9a-f]+): (R_X86_64_\w+)\s+(\S+?)(?:([+-])0x([0-9a-f]+))?$")


def disassemble(path: Path) -> list[Function]:
    try:
        out = subprocess.run(["objdump", "-dr", "-w", "--no-show-raw-insn", str(path)], capture_output=True,
                             text=True, check=True).stdout
    except FileNotFoundError as exc:
        raise BadInput("objdump not found (binutils)") from exc
    except subprocess.CalledProcessError as exc:
        raise BadInput(f"{path}: objdump failed: {exc.stderr.strip()[:200]}") from exc
    funcs: list[Function] = []
    for line in out.splitlines():
        m = _FUNC.match(line)
        if m:
            funcs.append(Function(m.group(2)))
            continue
        m = _INSN.match(line)
        if not m or not funcs:
            continue
        body = m.group(2)
        parts = body.split("\t")
        text, rest = parts[0], parts[1:]
        comment = ""
        if "#" in text:
            text, comment = text.split("#", 1)
        words = text.split(None, 1)
        if not words:
            continue
        mnemonic = words[0]
        if mnemonic in ("rep", "repz", "repnz", "lock", "notrack", "bnd") and len(words) > 1:
            more = words[1].split(None, 1)
            mnemonic = mnemonic + " " + more[0]
            words = [mnemonic] + more[1:]
        insn = Insn(int(m.group(1), 16), mnemonic, split_operands(words[1]) if len(words) > 1 else [], comment.strip())
        if rest:
            rm = _RELOC.match(" ".join(r.strip() for r in rest))
            if rm:
                addend = int(rm.group(5), 16) if rm.group(5) else 0
                insn.reloc = (rm.group(3), -addend if rm.group(4) == "-" else addend)
                insn.reloc_at = int(rm.group(1), 16)
        funcs[-1].insns.append(insn)
    for f in funcs:
        for a, b in zip(f.insns, f.insns[1:]):
            a.length = b.addr - a.addr
    return funcs


# ---------------------------------------------------------------------------------------------- replay
def parse_imm(op: str) -> int | None:
    if not op.startswith("$"):
        return None
    try:
        return int(op[1:], 0)
    except ValueError:
        return None


def parse_mem(op: str) -> tuple[int, str, str | None] | None:
    """(displacement, base, index) of an AT&T memory operand."""
    m = _MEM.match(op.split(":")[-1])
    if not m or not m.group(2):
        return None
    disp = int(m.group(1), 0) if m.group(1) else 0
    return disp, m.group(2)[1:], (m.group(3) or "")[1:] or None


class Replay:
    """Symbolic state of one basic block: known register bytes and known bytes at base+offset."""

    def __init__(self, elf: Elf, base: str) -> None:
        self.elf = elf
        self.base = base
        self.gpr: dict[str, bytes | None] = {}
        self.vec: dict[int, list[int | None]] = {}
        self.mem: dict[int, int | None] = {}

    # -- helpers
    def forget_memory(self) -> None:
        self.mem.clear()

    def forget(self, op: str) -> None:
        """An instruction we do not model writes ``op``."""
        if op.startswith("%"):
            name = op[1:]
            v = _VEC.match(op)
            if v:
                self.vec.pop(int(v.group(2)), None)
            elif name in _GPR_ALIASES:
                full = _GPR_ALIASES[name][0]
                self.gpr.pop(full, None)
                if full == self.base:
                    self.forget_memory()
        else:
            mem = parse_mem(op)
            if mem is None or mem[1] != self.base or mem[2] is not None:
                if mem is not None and mem[1] in ("rip",):
                    return
                self.forget_memory()  # an address we cannot relate to the base
            else:
                for k in range(mem[0], mem[0] + CONFIG_BYTES):
                    self.mem.pop(k, None)

    def rip_bytes(self, insn: Insn, n: int) -> bytes | None:
        if insn.reloc is not None:
            sym, addend = insn.reloc
            return self.elf.bytes_at_symbol(sym, addend + (insn.addr + insn.length - insn.reloc_at), n)
        m = re.match(r"([0-9a-f]+)", insn.comment)
        return self.elf.bytes_at_address(int(m.group(1), 16), n) if m else None

    def value_bytes(self, insn: Insn, op: str, n: int) -> list[int | None]:
        """The n bytes an operand provides (None = unknown)."""
        imm = parse_imm(op)
        if imm is not None:
            return list((imm & ((1 << (8 * n)) - 1)).to_bytes(n, "little"))
        v = _VEC.match(op)
        if v:
            reg = self.vec.get(int(v.group(2)))
            return list(reg[:n]) if reg else [None] * n
        if op.startswith("%") and op[1:] in _GPR_ALIASES:
            full, _w = _GPR_ALIASES[op[1:]]
            val = self.gpr.get(full)
            return list(val[:n]) if val else [None] * n
        mem = parse_mem(op)
        if mem is not None and mem[1] == "rip":
            data = self.rip_bytes(insn, n)
            return list(data) if data is not None else [None] * n
        if mem is not None and mem[1] == self.base and mem[2] is None:
            return [self.mem.get(mem[0] + k) for k in range(n)]
        return [None] * n

    def write_reg(self, op: str, data: list[int | None], vex: bool) -> None:
        v = _VEC.match(op)
        if v:
            idx = int(v.group(2))
            old = self.vec.get(idx) or [None] * CONFIG_BYTES
            new = list(data) + ([0] * (CONFIG_BYTES - len(data)) if vex else old[len(data):])
            self.vec[idx] = new[:CONFIG_BYTES]
            return
        full, width = _GPR_ALIASES[op[1:]]
        if any(b is None for b in data):
            self.gpr.pop(full, None)
            return
        old = self.gpr.get(full)
        if width >= 4:  # 32-bit writes zero-extend
            self.gpr[full] = bytes(data[:width]) + bytes(8 - width)
        elif old is not None:
            self.gpr[full] = bytes(data[:width]) + old[width:]
        else:
            self.gpr.pop(full, None)

    def store(self, op: str, data: list[int | None]) -> None:
        mem = parse_mem(op)
        if mem is None or mem[1] != self.base or mem[2] is not None:
            self.forget(op)
            return
        for k, b in enumerate(data):
            self.mem[mem[0] + k] = b

    # -- one instruction
    def step(self, insn: Insn) -> None:
        mn, ops = insn.mnemonic, insn.operands
        dst = ops[-1] if ops else ""
        if mn in _ZERO_IDIOMS and len(set(ops)) == 1 or (mn in _ZERO_IDIOMS and len(ops) == 3 and ops[0] == ops[1]):
            if _VEC.match(dst):
                self.write_reg(dst, [0] * _VEC_WIDTH[_VEC.match(dst).group(1)], mn.startswith("v"))
                return
        if mn in ("xor", "xorl", "xorq") and len(ops) == 2 and ops[0] == ops[1] and ops[0][1:] in _GPR_ALIASES:
            self.write_reg(dst, [0] * _GPR_ALIASES[ops[0][1:]][1], False)
            return
        if mn in _VEC_MOVES and len(ops) == 2 and "{" not in insn.comment + dst:
            src = ops[0]
            sv, dv = _VEC.match(src), _VEC.match(dst)
            width = _VEC_WIDTH[(sv or dv).group(1)] if (sv or dv) else 0
            if not width:
                self.forget(dst)
            elif dv:
                self.write_reg(dst, self.value_bytes(insn, src, width), mn.startswith("v"))
            else:
                self.store(dst, self.value_bytes(insn, src, width))
            return
        if mn in ("movq", "vmovq", "movd", "vmovd") and len(ops) == 2:
            n = 8 if mn.endswith("q") else 4
            if _VEC.match(dst):
                self.write_reg(dst, self.value_bytes(insn, ops[0], n), True)
            elif dst.startswith("%"):
                self.write_reg(dst, self.value_bytes(insn, ops[0], n), False)
            else:
                self.store(dst, self.value_bytes(insn, ops[0], n))
            return
        if mn in ("mov", "movb", "movw", "movl", "movq", "movabs") and len(ops) == 2:
            src = ops[0]
            if dst.startswith("%") and dst[1:] in _GPR_ALIASES:
                width = _GPR_ALIASES[dst[1:]][1]
                self.write_reg(dst, self.value_bytes(insn, src, width), False)
                return
            if src.startswith("%") and src[1:] in _GPR_ALIASES:
                width = _GPR_ALIASES[src[1:]][1]
            else:
                width = _SUFFIX_WIDTH.get(mn[-1] if mn != "mov" else "", 0)
            if width:
                self.store(dst, self.value_bytes(insn, src, width))
            else:
                self.forget(dst)
            return
        if mn.startswith(("push", "pop", "enter", "leave")) or mn.startswith(("rep", "stos", "movs")):
            self.forget_memory()
            for r in ("rsp", "rdi", "rsi", "rcx", "rbp" if mn.startswith(("leave", "pop")) else "rsp"):
                self.gpr.pop(r, None)
            return
        if mn == "vzeroupper":
            for reg in self.vec.values():
                reg[16:] = [0] * (CONFIG_BYTES - 16)
            return
        if mn == "vzeroall":
            self.vec = {i: [0] * CONFIG_BYTES for i in range(16)}
            return
        # anything else: its explicit destination becomes unknown, and so do the implicit ones
        if dst:
            self.forget(dst)
        for r in ("rax", "rdx"):  # cltd, idiv, mul, cpuid-like implicit writers
            self.gpr.pop(r, None)

    def config_at(self, disp: int) -> list[int | None]:
        return [self.mem.get(disp + k) for k in range(CONFIG_BYTES)]


# ---------------------------------------------------------------------------------------------- expectations
def expected_config(source: Path) -> bytes:
    """The configuration ggml_tile_config_init assigns in the source (fields not assigned are zero)."""
    try:
        text = source.read_text()
    except OSError as exc:
        raise BadInput(f"{source}: cannot read: {exc.strerror}") from exc
    cfg = bytearray(CONFIG_BYTES)
    found = False
    for m in re.finditer(r"\btc\.(palette_id|start_row)\s*=\s*(\d+)\s*;", text):
        cfg[0 if m.group(1) == "palette_id" else 1] = int(m.group(2))
        found = True
    for m in re.finditer(r"\btc\.(rows|colsb)\[(\d+)\]\s*=\s*(\d+)\s*;", text):
        i, v = int(m.group(2)), int(m.group(3))
        if m.group(1) == "rows":
            cfg[48 + i] = v
        else:
            struct.pack_into("<H", cfg, 16 + 2 * i, v)
        found = True
    if not found or cfg[0] == 0:
        raise BadInput(f"{source}: no `tc.palette_id = N;` / `tc.rows[i] = N;` assignments found")
    return bytes(cfg)


def describe(got: list[int | None], want: bytes) -> str:
    """The fields that differ, named as in tile_config_t."""
    def field_of(k: int) -> str:
        if k == 0:
            return "palette_id"
        if k == 1:
            return "start_row"
        if k < 16:
            return "reserved"
        if k < 48:
            return f"colsb[{(k - 16) // 2}]"
        return f"rows[{k - 48}]"

    bad: dict[str, str] = {}
    for k in range(CONFIG_BYTES):
        if got[k] != want[k]:
            name = field_of(k)
            if name not in bad:
                if name.startswith("colsb"):
                    lo = 16 + 2 * ((k - 16) // 2)
                    g = got[lo:lo + 2]
                    have = "never written" if None in g else str(g[0] + 256 * g[1])
                    exp = str(want[lo] + 256 * want[lo + 1])
                else:
                    have = "never written" if got[k] is None else str(got[k])
                    exp = str(want[k])
                bad[name] = f"{name} {have} (expected {exp})"
    return ", ".join(bad.values())


# ---------------------------------------------------------------------------------------------- driver
def block_start(func: Function, idx: int) -> int:
    """Index of the first instruction of the basic block holding func.insns[idx]."""
    targets = set()
    for insn in func.insns:
        if _CONTROL.match(insn.mnemonic) and insn.operands:
            m = re.match(r"^([0-9a-f]+)(?: <.*>)?$", insn.operands[0])
            if m:
                targets.add(int(m.group(1), 16))
    start = idx
    while start > 0:
        prev = func.insns[start - 1]
        if _CONTROL.match(prev.mnemonic.split()[0]) or func.insns[start].addr in targets:
            break
        start -= 1
    return start


def check(path: Path, want: bytes) -> tuple[int, list[str]]:
    """(number of ldtilecfg found, failure messages)."""
    elf = Elf(path)
    n, failures = 0, []
    for func in disassemble(path):
        for i, insn in enumerate(func.insns):
            if insn.mnemonic != "ldtilecfg":
                continue
            n += 1
            where = f"{path.name}: ldtilecfg at {insn.addr:#x} in {func.name}"
            mem = parse_mem(insn.operands[0]) if insn.operands else None
            if mem is None or mem[2] is not None:
                failures.append(f"{where}: operand {insn.operands} is not base+displacement; cannot check")
                continue
            replay = Replay(elf, mem[1])
            for prior in func.insns[block_start(func, i):i]:
                replay.step(prior)
            got = replay.config_at(mem[0])
            if got != list(want):
                failures.append(f"{where}: the configuration it reads is not the one the source assigns: "
                                f"{describe(got, want)}")
    return n, failures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("binary", type=Path, help="an x86-64 ELF object, shared library or executable")
    ap.add_argument("--source", type=Path, required=True,
                    help="the mmq.cpp it was compiled from (the expected tile configuration)")
    args = ap.parse_args(argv)
    try:
        want = expected_config(args.source)
        if not args.binary.is_file():
            raise BadInput(f"{args.binary}: no such file")
        n, failures = check(args.binary, want)
    except BadInput as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for f in failures:
        print(f)
    print(f"{args.binary}: {n} ldtilecfg, {n - len(failures)} read the full configuration", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
