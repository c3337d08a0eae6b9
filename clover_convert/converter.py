"""The conversion itself: read and check the checkpoint, plan, then stream the GGUF into place."""

from __future__ import annotations

import logging
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from gguf import GGML_QUANT_VERSION, GGUFWriter, Metadata, naming_convention, size_label
from gguf.utility import model_weight_count_rounded_notation
from tqdm import tqdm

from clover_common.block_settings import GENERATION_CONFIG_FILE, Overrides, read_generation_config
from clover_common.config import CONFIG_FILE, CloverConfig, is_number
from clover_common.config_numbers import F32_MAX, METADATA_RULES
from clover_common.errors import BadInput, CloverInputError
from clover_common.input_files import CONFIG, MODEL_CARD, check_input_dir, check_input_file, present, read_json

from clover_quantize.importance import load_imatrix
from clover_quantize.file_types import FileType, UnknownTypeError, file_type

from .model_keys import ARCH, add_clover_keys, add_model_keys, check_upstream_layout
from .onepass import OnePassResult, write_header_and_hole, write_quantized
from .output import AtomicOutput, OutputError, check_free_space, check_outputs, resolve_output_path, output_shard_paths
from .safetensors_index import CheckpointIndex, index_checkpoint
from .sidecar import FINGERPRINT_KEY, SIDECAR_TYPE, config_fingerprint, is_bd_tensor, sidecar_path
from .streaming import ChunkPipeline, StreamedTensor
from .tensor_plan import ConversionPlan, OutType, build_plan
from .tokenizer_keys import TOKENIZER_FILE, add_tokenizer_keys, read_tokenizer_keys

log = logging.getLogger(__name__)

_AUTO_TYPES = {"BF16": OutType.BF16, "F16": OutType.F16, "F32": OutType.F16}  # as llama.cpp's --outtype auto
_LOGICAL = np.dtype(np.float32)  # any dtype but uint8 makes GGUFWriter take the given shape as the logical one


@dataclass
class ConvertOptions:
    model_dir: Path
    outfile: Path | None = None
    outtype: str = "auto"  # an OutType label or "auto"
    split_max_size: int = 0
    split_max_tensors: int = 0
    dry_run: bool = False
    skeleton: bool = False  # with dry_run: write the header and a sparse, all-zero data region (for planning)
    metadata: Path | None = None
    threads: int = 2
    allow_nonfinite: bool = False  # NaN/inf weights: a warning per tensor instead of an error
    progress: bool | None = None  # None: a progress bar only when stderr is a terminal
    imatrix: Path | None = None  # with a quantization type (clover-quantize's --imatrix)
    block_settings: Overrides = Overrides()  # --mask-token, --block-size, --threshold, ... (spec 2.2)
    conv_right_order: str = "cd"  # --conv-right-order (spec 2.3)
    arch: str = ARCH  # --arch-name (spec 5)
    bd_form: str = "single"  # one of BD_FORMS: the block-diffusion tensors in the file (spec 5, "Files")


# where the block-diffusion keys and tensors go (spec 5): in the one file (default); in a sidecar NAME.bd.gguf
# beside a trunk-only NAME.gguf (--bd-sidecar); or only a sidecar, at the output path (--bd-only)
BD_FORMS = ("single", "sidecar", "only")


@dataclass
class ConvertResult:
    plan: ConversionPlan
    out_type: OutType
    paths: list[Path]  # the written files, or the files a dry run would write
    shard_sizes: list[tuple[int, int]]  # (tensor count, tensor bytes) per file
    metadata: Metadata | None = None  # the general.* keys written
    quantized: OnePassResult | None = None  # a quantization type: llama.cpp's plan and the time split


# clover-quantize types that are conversions, not quantizations
UNQUANTIZED_FILE_TYPES = ("F32", "F16", "BF16")


def quantization_type(label: str) -> FileType | None:
    """The clover-quantize type an ``--outtype`` names (case-insensitive), or None for a conversion type.
    ``q8_0`` in lower case stays the converter's own Q8_0 (as convert_hf_to_gguf writes it); ``Q8_0`` is
    llama.cpp's Q8_0 mix, as clover-quantize writes it."""
    if label in {t.label for t in OutType} or label == "auto":
        return None
    try:
        ft = file_type(label)
    except UnknownTypeError:
        return None
    return None if ft.name in UNQUANTIZED_FILE_TYPES else ft


def _first_matrix_dtype(index: CheckpointIndex) -> str | None:
    """The safetensors dtype of the checkpoint's first matrix (what ``auto`` and the one-pass route go by)."""
    return next((source.dtype for source in index.tensors.values() if len(source.shape) >= 2), None)


def source_out_type(index: CheckpointIndex) -> OutType:
    """The precision of the checkpoint's matrices (the first one's dtype): what the two-step route converts
    to before quantizing, so that nothing is rounded twice."""
    dtype = _first_matrix_dtype(index)
    return {"BF16": OutType.BF16, "F16": OutType.F16, "F32": OutType.F32}[dtype] if dtype else OutType.BF16


def resolve_out_type(label: str, index: CheckpointIndex | None, raw_config: dict[str, Any]) -> OutType:
    """``auto`` takes the dtype of the first matrix (BF16 -> bf16, F16 or F32 -> f16, like llama.cpp); a
    config-only checkpoint uses config.json's ``torch_dtype``/``dtype`` and otherwise bf16."""
    if label != "auto":
        return OutType.from_label(label)
    if index is not None and (dtype := _first_matrix_dtype(index)) is not None:
        return _AUTO_TYPES[dtype]
    declared = raw_config.get("torch_dtype") or raw_config.get("dtype")
    return {"float16": OutType.F16, "float32": OutType.F16}.get(str(declared), OutType.BF16)


def _load_metadata_override(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    data = read_json(path, flag="--metadata")
    if not isinstance(data, dict):
        raise CloverInputError(path, "must hold a JSON object of general.* keys")
    for rule in METADATA_RULES:  # numbers written as general.sampling.* (docs/gguf-format.md)
        if rule.field in data and (why := rule.check(data[rule.field])) is not None:
            raise CloverInputError(f"--metadata {path}", why, field=rule.field)
    return data


def load_metadata(metadata_path: Path | None, model_dir: Path, total: int) -> Metadata:
    """gguf's ``Metadata.load``. It opens the model card (README.md), config.json, generation_config.json and the
    --metadata file by name and skips what is not a regular file: each is checked first, as every input is
    (clover_common.input_files), so that none is read past its cap or skipped for being a fifo or a directory."""
    card = model_dir / "README.md"
    for path, kind in ((card, MODEL_CARD), (model_dir / CONFIG_FILE, CONFIG),
                       (model_dir / GENERATION_CONFIG_FILE, CONFIG)):
        if present(path):
            check_input_file(path, kind)
    if metadata_path is not None:
        check_input_file(metadata_path, CONFIG, "--metadata")
    try:
        return Metadata.load(metadata_path, model_dir, None, total)
    except UnicodeDecodeError as exc:  # the model card (the JSON files were read before)
        raise CloverInputError(card, f"is not UTF-8 text (byte {exc.start})") from None
    except yaml.YAMLError as exc:
        raise CloverInputError(card, f"has front matter that is not valid YAML ({exc})") from None


def moe_size_label(total: int, shared: int, expert: int, expert_count: int, expert_used: int) -> str:
    """The size label model hubs show for a MoE, "35B-A3B": total parameters, then the active ones (the shared
    parameters plus ``expert_used`` experts), in gguf's rounded notation (``gguf.utility``). gguf's own
    ``size_label`` helper would write "256x<per-expert size>"; a dense model keeps its plain label ("7.6B")."""
    if expert_count <= 0 or expert_used <= 0:
        return size_label(total, shared, expert, expert_count)
    active = shared + min(expert_used, expert_count) * expert
    return (f"{model_weight_count_rounded_notation(total, min_digits=2)}"
            f"-A{model_weight_count_rounded_notation(active, min_digits=1)}")


def _describe_model(writer: GGUFWriter, model_dir: Path, metadata_path: Path | None,
                    override: dict[str, Any], expert_used: int) -> Metadata:
    """general.* keys, as ``ModelBase.prepare_metadata`` sets them (gguf's ``Keys.General`` names): from the model
    card (README.md front matter: name, license, base_model, tags, ...) and config.json, then the --metadata file.
    Unlike gguf's Metadata.load, the file may also set general.license. The size label, when neither the card
    nor the model's name gives one, is "<total>-A<active>" (moe_size_label)."""
    total, shared, expert, expert_count = writer.get_total_parameter_count()
    metadata = load_metadata(metadata_path, model_dir, total)
    metadata.license = override.get("general.license", metadata.license)
    if metadata.sampling_penalty_repeat is None and "general.sampling.penalty_repeat" not in override:
        # the pinned llama.cpp's Metadata.load also reads generation_config.json's repetition_penalty (the wheel's
        # gguf does not); the release's penalties are named that way (spec 4)
        generation = Metadata.load_generation_config(model_dir)
        if isinstance(generation, dict) and isinstance(generation.get("repetition_penalty"), (int, float)):
            metadata.sampling_penalty_repeat = float(generation["repetition_penalty"])
    if metadata.name is None:
        metadata.name = model_dir.name
    if metadata.size_label is None and total > 0:
        metadata.size_label = moe_size_label(total, shared, expert, expert_count, expert_used)
    return metadata


# generation_config.json's penalties beside general.sampling.penalty_repeat (spec 2.2 "penalties", spec 4): the
# defaults of the engine and of llama.cpp's common_sampler (docs/gguf-format.md). Older files carry them as
# ARCH.sampling.presence_penalty / frequency_penalty, which the engine still reads.
PENALTY_KEYS = {"presence_penalty": "general.sampling.penalty_present",
                "frequency_penalty": "general.sampling.penalty_freq"}


def read_penalties(model_dir: Path) -> dict[str, float]:
    """{GGUF key: value} of generation_config.json's presence_penalty and frequency_penalty (absent or null:
    no key). Any other value than a finite number is refused: the engine would refuse the file at load."""
    generation = read_generation_config(model_dir)
    if generation is None:
        return {}
    path = model_dir / GENERATION_CONFIG_FILE
    out = {}
    for name, key in PENALTY_KEYS.items():
        value = generation.get(name)
        if value is None:
            continue
        # a float32 (a huge int would not even convert)
        number = float(value) if is_number(value) and abs(value) <= F32_MAX else math.nan
        if not math.isfinite(number):
            raise CloverInputError(path, f"must be a finite number (0 = off), got {value!r}", name)
        out[key] = number
    return out


def _index_weights(model_dir: Path, dry_run: bool) -> CheckpointIndex | None:
    """The checkpoint's tensors; None for a config-only directory, which only a dry run accepts."""
    index = index_checkpoint(model_dir)
    if not index.files:
        if not dry_run:
            raise CloverInputError(model_dir, "holds no safetensors weights (model.safetensors or an index)")
        log.warning("%s holds no weights: planning from config.json alone", model_dir)
        return None
    if index.skipped:
        log.warning("skipping %d vision/MTP tensors (e.g. '%s')", len(index.skipped), index.skipped[0])
    return index


def convert(options: ConvertOptions) -> ConvertResult:
    """Convert (or, with ``dry_run``, only plan). Raises CloverInputError for unusable input and OutputError
    when the output cannot be written; either way no output file is left behind."""
    check_input_dir(options.model_dir, "a Hugging Face checkpoint")
    model_dir = options.model_dir.resolve()
    config = CloverConfig.load(model_dir, options.block_settings)
    check_upstream_layout(config, model_dir / CONFIG_FILE)
    if options.bd_form == "only":
        return _convert_bd_only(options, model_dir, config)
    sidecar = options.bd_form == "sidecar"
    if sidecar and options.skeleton:
        raise OptionError("--skeleton writes one planning file: leave out --bd-sidecar")
    raw_config = read_json(model_dir / CONFIG_FILE)
    penalties = read_penalties(model_dir)
    metadata_override = _load_metadata_override(options.metadata)
    quant = quantization_type(options.outtype)
    _check_quantization_options(options, quant)
    index = _index_weights(model_dir, options.dry_run)
    imatrix = load_imatrix(options.imatrix) if options.imatrix is not None else None
    out_type = source_out_type(index) if quant is not None and index is not None else \
        resolve_out_type(options.outtype, index, raw_config)
    plan = build_plan(config, out_type, index, options.conv_right_order)
    trunk_plan = plan.subset(lambda name: not is_bd_tensor(name)) if sidecar else plan
    if options.dry_run and not present(model_dir / TOKENIZER_FILE):
        log.warning("%s has no %s: the plan leaves out the tokenizer keys", model_dir, TOKENIZER_FILE)
        tokenizer = None
    else:
        tokenizer = read_tokenizer_keys(model_dir, config.vocab_size, config.mask_token_id)

    writer = GGUFWriter(None, options.arch, split_max_tensors=options.split_max_tensors,
                        split_max_size=options.split_max_size)
    pipeline = None if options.dry_run or quant is not None else \
        ChunkPipeline(trunk_plan, options.threads, options.allow_nonfinite)
    bd_writer = None
    try:
        _add_tensors(writer, trunk_plan, pipeline)
        metadata = _describe_model(writer, model_dir, options.metadata, metadata_override, config.num_experts_per_tok)
        writer.add_type("model")
        metadata.set_gguf_meta_model(writer)
        add_model_keys(writer, config, raw_config, model_dir / CONFIG_FILE, out_type.file_type,
                       block_diffusion=not sidecar)
        for key, value in penalties.items():  # in the trunk too: the engine reads its defaults there
            writer.add_float32(key, value)
        writer.add_quantization_version(GGML_QUANT_VERSION)
        if tokenizer is not None:
            add_tokenizer_keys(writer, tokenizer)

        type_name = quant.name if quant is not None else out_type.ggml_type.name
        default_stem = naming_convention(metadata.name, metadata.basename, metadata.finetune, metadata.version,
                                         metadata.size_label, type_name)
        final_path = resolve_output_path(model_dir, options.outfile, default_stem, type_name)
        shard_sizes = [(len(shard), sum(ti.nbytes for ti in shard.values())) for shard in writer.tensors]
        paths = output_shard_paths(final_path, len(writer.tensors))
        bd = _Sidecar(plan.subset(is_bd_tensor), sidecar_path(final_path)) if sidecar else None
        if bd is not None:
            paths.append(bd.path)
            shard_sizes.append((len(bd.plan.tensors), bd.plan.nbytes))
        result = ConvertResult(plan, out_type, paths, shard_sizes, metadata)
        if options.dry_run and not options.skeleton:
            return result
        inputs = _inputs(model_dir, index, options.metadata) + ([imatrix.path] if imatrix is not None else [])
        check_outputs(paths, inputs)  # before any work: never a device, a directory or an input
        if options.dry_run:
            result.paths = _write_skeleton(writer, plan, final_path, inputs)
            return result
        with AtomicOutput(final_path, inputs) as output:
            if bd is not None:
                assert tokenizer is not None
                bd_writer = _sidecar_writer(config, options.arch, tokenizer.tokens, metadata.name)
                _write_sidecar(bd_writer, bd.plan, output, bd.path, options)
            if quant is not None:
                result.quantized = write_quantized(writer, trunk_plan, output, quant, imatrix,
                                                   options.threads, options.progress, options.allow_nonfinite)
            else:
                assert pipeline is not None
                _write(writer, pipeline, trunk_plan, output.temp_path, final_path, options.progress)
            output.publish(len(writer.tensors))
        return result
    finally:
        if pipeline is not None:
            pipeline.close()
        writer.close()
        if bd_writer is not None:
            bd_writer.close()


@dataclass
class _Sidecar:
    plan: ConversionPlan  # the block-diffusion tensors
    path: Path


def _add_tensors(writer: GGUFWriter, plan: ConversionPlan, pipeline: ChunkPipeline | None) -> None:
    """The plan's tensors, streamed from ``pipeline``, or as tensor infos alone (a plan, or one-pass quantization,
    which writes the data itself)."""
    for tensor in plan.tensors:
        if pipeline is None:
            writer.add_tensor_info(tensor.name, tensor.shape, _LOGICAL, tensor.nbytes, raw_dtype=tensor.ggml_type)
        else:
            writer.add_tensor(tensor.name, StreamedTensor(tensor, pipeline), raw_shape=tensor.shape,  # type: ignore[arg-type]
                              raw_dtype=tensor.ggml_type)


def _sidecar_writer(config: CloverConfig, arch: str, tokens: list[str], name: str | None) -> GGUFWriter:
    """A sidecar's header (spec 5): the block-diffusion keys, the mask token and the trunk's fingerprint."""
    writer = GGUFWriter(None, arch)
    writer.add_type(SIDECAR_TYPE)
    if name:
        writer.add_name(name)
    writer.add_string(f"{arch}.{FINGERPRINT_KEY}", config_fingerprint(config, tokens))
    add_clover_keys(writer, config)
    writer.add_mask_token_id(config.mask_token_id)
    return writer


def _write_sidecar(writer: GGUFWriter, plan: ConversionPlan, output: AtomicOutput, final: Path,
                   options: ConvertOptions) -> None:
    pipeline = ChunkPipeline(plan, options.threads, options.allow_nonfinite)
    try:
        _add_tensors(writer, plan, pipeline)
        _write(writer, pipeline, plan, output.companion(final), final, progress=False)
    finally:
        pipeline.close()


def _convert_bd_only(options: ConvertOptions, model_dir: Path, config: CloverConfig) -> ConvertResult:
    """--bd-only OUT.bd.gguf: the sidecar alone. Only the block-diffusion tensors are read, by name; the trunk's
    tensors are never streamed (only the safetensors headers are read)."""
    if options.outfile is None:
        raise OptionError("--bd-only needs the sidecar's path (--bd-only OUT.bd.gguf)")
    for given, why in ((options.outtype != "auto", f"--outtype {options.outtype}"),
                       (options.imatrix is not None, "--imatrix"), (options.skeleton, "--skeleton"),
                       (bool(options.split_max_size or options.split_max_tensors), "--split-max-*")):
        if given:
            raise OptionError(f"--bd-only writes only the F32 block-diffusion tensors: {why} does not apply")
    index = _index_weights(model_dir, options.dry_run)
    plan = build_plan(config, OutType.F32, index, options.conv_right_order, only=is_bd_tensor)
    tokenizer = read_tokenizer_keys(model_dir, config.vocab_size, config.mask_token_id)
    _load_metadata_override(options.metadata)  # checked as the full conversion checks it
    name = load_metadata(options.metadata, model_dir, 0).name or model_dir.name
    final_path = options.outfile
    result = ConvertResult(plan, OutType.F32, [final_path], [(len(plan.tensors), plan.nbytes)])
    if options.dry_run:
        return result
    inputs = _inputs(model_dir, index, options.metadata)
    check_outputs([final_path], inputs)
    writer = _sidecar_writer(config, options.arch, tokenizer.tokens, name)
    try:
        with AtomicOutput(final_path, inputs) as output:
            pipeline = ChunkPipeline(plan, options.threads, options.allow_nonfinite)
            try:
                _add_tensors(writer, plan, pipeline)
                _write(writer, pipeline, plan, output.temp_path, final_path, options.progress)
            finally:
                pipeline.close()
            output.publish(1)
    finally:
        writer.close()
    return result


class OptionError(BadInput):
    """Options that do not go together; the message names them."""


def _check_quantization_options(options: ConvertOptions, quant: FileType | None) -> None:
    if quant is None:
        if options.imatrix is not None:
            raise OptionError(f"--imatrix {options.imatrix} goes with a quantization type (--outtype Q4_K_M, ...), "
                              f"not --outtype {options.outtype}")
        return
    if options.split_max_size or options.split_max_tensors:
        raise OptionError(f"--outtype {quant.name} writes one file: split it afterwards "
                          "(llama-gguf-split), or convert with --split-max-* and run clover-quantize --keep-split")
    if options.dry_run:
        raise OptionError(f"--dry-run plans a conversion, not --outtype {quant.name}: plan with "
                          "`clover-convert --dry-run --skeleton` and `clover-quantize SKELETON --dry-run TYPE`")
    if quant.wants_imatrix and options.imatrix is None:
        log.warning("--outtype %s without --imatrix is allowed, as in llama-quantize, but an importance matrix "
                    "improves it most (docs/quantize.md: an imatrix without a full-precision GGUF)", quant.name)


def _inputs(model_dir: Path, index: CheckpointIndex | None, metadata: Path | None) -> list[Path]:
    """Every file the conversion may read: the checkpoint directory's files (a GGUF there is an earlier output,
    not an input), the weight shards and the --metadata file. No output may be one of them."""
    files = [p for p in model_dir.iterdir() if p.suffix != ".gguf" and p.is_file()]
    files += index.files if index is not None else []
    return files + ([metadata] if metadata is not None else [])


def _write_skeleton(writer: GGUFWriter, plan: ConversionPlan, final_path: Path, inputs: list[Path]) -> list[Path]:
    """The real header, key/values and tensor infos, followed by a data region that is a hole: the file has
    its full size but occupies almost no disk. llama.cpp's loader accepts it, so planning tools such as
    ``clover-quantize --dry-run`` see the exact model (its weights are zeros: never run it)."""
    with AtomicOutput(final_path, inputs) as output:
        try:
            write_header_and_hole(writer, output.temp_path)
            return output.publish(len(writer.tensors))
        except OSError as exc:
            raise OutputError(final_path, f"cannot be written ({exc.strerror or exc})") from None


def _write(writer: GGUFWriter, pipeline: ChunkPipeline, plan: ConversionPlan, temp_path: Path, final_path: Path,
           progress: bool | None) -> None:
    """Stream ``writer``'s file (its shards) to ``temp_path``; errors name ``final_path``."""
    check_free_space(final_path.parent, plan.nbytes)
    bar = tqdm(total=plan.nbytes, unit="B", unit_scale=True, unit_divisor=1024, desc="clover-convert",
               file=sys.stderr, disable=None if progress is None else not progress, dynamic_ncols=True)
    pipeline.on_bytes = bar.update
    try:
        writer.write_header_to_file(path=temp_path)
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file(progress=False)
        writer.close()
    except OSError as exc:  # source reads raise CloverInputError, so this is the output
        raise OutputError(final_path, f"cannot be written ({exc.strerror or exc})") from None
    finally:
        bar.close()
