"""Model files for the tests and the benchmarks: a GGUF by clover-convert, a quantized copy by llama-quantize, the
stripped Qwen3.5-MoE twin of a Clover checkpoint, and its GGUF by llama.cpp's own (vendored) converter. A tool that
fails raises ``RuntimeError`` with the end of what it printed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from safetensors import safe_open

from clover_common.config import qwen_twin_config
from clover_common.layout import is_clover_tensor
from clover_dev import REPO_ROOT, VENV_PYTHON

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
TAIL = 3000  # characters of a failed tool's output kept in the error


def run_tool(cmd: list[str], *, with_stdout: bool = False) -> subprocess.CompletedProcess[str]:
    """Run ``cmd``; a non-zero exit raises with its stderr's tail (stdout + stderr with ``with_stdout``)."""
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        out = (done.stdout + done.stderr) if with_stdout else done.stderr
        raise RuntimeError(f"{Path(cmd[0]).name} {' '.join(cmd[1:3])} ... exited with {done.returncode}:\n"
                           f"{out[-TAIL:]}")
    return done


def clover_convert(model_dir: Path, out: Path, outtype: str = "f32", *options: str) -> Path:
    """clover-convert (our converter) in a subprocess; ``options`` are more of its flags."""
    run_tool([str(VENV_PYTHON), "-m", "clover_convert", str(model_dir), "--outfile", str(out), "--outtype", outtype,
              *options])
    return out


def quantize(src: Path, dst: Path, qtype: str = "Q8_0") -> Path:
    """llama.cpp's own llama-quantize of the native build (not clover-quantize)."""
    from clover_native import loader

    tool = loader.tool_path("llama-quantize")
    if not tool.exists():
        raise FileNotFoundError(f"{tool} missing (make native)")
    run_tool([str(tool), str(src), str(dst), qtype], with_stdout=True)
    return dst


def make_qwen_twin(src: Path, dst: Path) -> Path:
    """The same weights without the Clover tensors, with a plain Qwen3.5-MoE config: what llama.cpp converts."""
    from safetensors.torch import save_file  # torch: the checkpoints hold bf16, which numpy cannot

    dst.mkdir(parents=True)
    config = qwen_twin_config(json.loads((src / "config.json").read_text()))
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        shutil.copy(src / name, dst / name)
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys() if not is_clover_tensor(n)}
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def vendored_tree() -> Path:
    """The pinned llama.cpp tree, fetched and unpacked by scripts/llama_sdist.py if it is not there yet."""
    done = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "llama_sdist.py"), "unpack"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"scripts/llama_sdist.py unpack failed:\n{done.stderr}")
    tree = Path(done.stdout.strip().splitlines()[-1]) / "vendor" / "llama.cpp"
    if not (tree / "convert_hf_to_gguf.py").is_file():
        raise FileNotFoundError(f"{tree} has no convert_hf_to_gguf.py")
    return tree


def vendored_convert(model_dir: Path, out: Path, outtype: str) -> Path:
    """llama.cpp's convert_hf_to_gguf.py with its own gguf-py (scripts/vendored_convert.py)."""
    run_tool([str(VENV_PYTHON), str(REPO_ROOT / "scripts" / "vendored_convert.py"), str(model_dir),
              "--outfile", str(out), "--outtype", outtype, "--tree", str(vendored_tree())])
    return out
