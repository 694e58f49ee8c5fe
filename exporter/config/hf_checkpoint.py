"""A Hugging Face checkpoint, checked when the job's config is composed: importing transformers
loads torch, seconds before a wrong checkpoint could be refused. A checkpoint is a directory
written by save_pretrained() (its config.json says what it is), or a GGUF file, llama.cpp's
format, named itself or as the one .gguf of a directory without config.json (its header says
its architecture; transformers dequantizes its weights into a float model).

The files are untrusted, and read here without torch: a GGUF file's header and a safetensors
file's must describe bytes the file has (exporter/config/gguf_header.py; below), and a pickle of
weights (pytorch_model.bin) may import nothing that torch.load(weights_only=True) would not, as
its opcodes say: a truncated, corrupt or hostile file is refused in a line, not seconds into the
job by a loader's traceback or by torch's advice to unpickle it with weights_only=False.

The model types transformers implements, the task each checkpoint's architecture holds (a causal
LM, an encoder-only text model with its masked-LM head or headless, an image classifier: HfTask)
and the GGUF
architectures it reads are taken from transformers' own tables (models/auto/auto_mappings.py,
models/auto/modeling_auto.py, integrations/ggml.py) as the data they are, without importing it.
Where a table cannot be read (another layout of transformers), its check is left to the model
stage (exporter/models/hf.py), which imports transformers.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import mmap
import pickletools
import struct
import zipfile
import zlib
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, fields
from enum import Enum
from functools import cache
from math import prod
from pathlib import Path

from exporter.config import gguf_header
from exporter.errors import ConfigError

CONFIG_FILE = "config.json"
GGUF_SUFFIX = ".gguf"
# The weights of a save_pretrained() directory, in the order transformers looks for them: one
# file, or an index of the shards (modeling_utils._get_resolved_checkpoint_files).
SAFETENSORS_FILES = ("model.safetensors", "model.safetensors.index.json")
PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json")
# What the safetensors package reads at most of a header (MAX_HEADER_SIZE), and the bits of a
# value of each of its dtypes.
_SAFETENSORS_HEADER_LIMIT = 100_000_000
_SAFETENSORS_BITS = {
    **dict.fromkeys(("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0"), 8),
    **dict.fromkeys(("F8_E4M3FNUZ", "F8_E5M2FNUZ"), 8),
    **dict.fromkeys(("I16", "U16", "F16", "BF16"), 16),
    **dict.fromkeys(("I32", "U32", "F32"), 32),
    **dict.fromkeys(("I64", "U64", "F64", "C64"), 64),
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
}
# What torch.load(weights_only=True) imports besides torch's own names (torch.*), as
# torch/_weights_only_unpickler.py's _get_allowed_globals lists them: a state dict's containers,
# bytes. A name outside both is code that unpickling would run.
_PICKLE_IMPORTS = frozenset(
    (
        "collections.OrderedDict",
        "collections.Counter",
        "_codecs.encode",
        "builtins.bytearray",
        "builtins.set",
        "builtins.complex",
    )
)
# The pickles at the start of torch.save()'s format before the zip archive (torch 1.6): a magic
# number, the protocol's version, the system's sizes, the object, its storages' keys.
_LEGACY_PICKLES = 5
# Opcodes that push a string, and those that leave the stack as it is: STACK_GLOBAL imports the
# module and the name of the two strings pushed last.
_STRING_OPCODES = {
    "STRING",
    "BINSTRING",
    "SHORT_BINSTRING",
    "UNICODE",
    "BINUNICODE",
    "SHORT_BINUNICODE",
    "BINUNICODE8",
}
_STACK_KEEPING_OPCODES = {"PROTO", "FRAME", "MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"}
_TABLES = {
    # Every model type transformers has a config class for.
    "configs": (("models", "auto", "auto_mappings.py"), "CONFIG_MAPPING_NAMES"),
    # The model types AutoModelForCausalLM loads, each with its class.
    "causal_lms": (("models", "auto", "modeling_auto.py"), "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    # The model types AutoModelForMaskedLM loads, those AutoModel loads headless, and the
    # encoder-decoders (AutoModelForSeq2SeqLM), each with its class or classes.
    "masked_lms": (("models", "auto", "modeling_auto.py"), "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),
    "headless": (("models", "auto", "modeling_auto.py"), "MODEL_MAPPING_NAMES"),
    "encoder_decoders": (
        ("models", "auto", "modeling_auto.py"),
        "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    ),
    # The model types AutoModelForSpeechSeq2Seq loads (Whisper), each with its class.
    "speech_recognizers": (
        ("models", "auto", "modeling_auto.py"),
        "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
    ),
    # The model types AutoModelForImageTextToText loads (vision-language models), each with its
    # class.
    "vision_lms": (
        ("models", "auto", "modeling_auto.py"),
        "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
    ),
    # The model types AutoModelForImageClassification loads, each with its class or classes.
    "image_classifiers": (
        ("models", "auto", "modeling_auto.py"),
        "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    ),
    # The GGUF architectures transformers reads, keyed by its model type ("general" and
    # "tokenizer" are sections of every file, not architectures).
    "gguf": (("integrations", "ggml.py"), "GGUF_CONFIG_MAPPING"),
}
_GGUF_SECTIONS = {"general", "tokenizer"}
# llama.cpp's names that transformers' GGUF loader renames to its model types
# (modeling_gguf_pytorch_utils.load_gguf_checkpoint); every other name is the model type.
_GGUF_RENAMES = {
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    "gpt-oss": "gpt_oss",
    "minimax-m2": "minimax_m2",
}


# The vision-language models model=hf exports (exporter/models/hf_vision_lm.py: their vision
# tower and connector as its encode method computes them).
VISION_LM_TYPES = ("smolvlm",)


class HfTask(Enum):
    """What a checkpoint's architecture computes, which model=hf exports: a causal LM's logits
    (`causal_lm`), an encoder-only text model's masked-LM logits (`masked_lm`) or its last
    hidden state (`encoder`, saved headless), an image classifier's logits
    (`image_classification`), Whisper's next-token logits after its encoder read a clip
    (`speech_recognition`), SmolVLM's after its vision tower read an image (`vision_lm`)."""

    causal_lm = "causal_lm"
    masked_lm = "masked_lm"
    encoder = "encoder"
    image_classification = "image_classification"
    speech_recognition = "speech_recognition"
    vision_lm = "vision_lm"

    @property
    def kind(self) -> str:
        """What a model of this task is, in a message."""
        if self is HfTask.image_classification:
            return "an image classifier"
        if self is HfTask.speech_recognition:
            return "a speech recognizer"
        if self is HfTask.vision_lm:
            return "a vision-language model"
        if self is HfTask.causal_lm:
            return "a causal LM"
        return "an encoder-only text model"


@dataclass(frozen=True)
class Architecture:
    """A checkpoint's task and its model type, as its config says."""

    task: HfTask
    model_type: str

    def causal_only(self, setting: str, checkpoint: object) -> ConfigError:
        """The refusal of `setting`, which only a causal LM takes, for this encoder."""
        return ConfigError(
            f"{setting}: model.checkpoint={checkpoint} is {self.task.kind} "
            f"(model_type {self.model_type!r}, task {self.task.value}); {setting} is a causal "
            "LM's alone."
        )


# Names of transformers' classes by model type (one name or a tuple of them), as its tables hold
# them: {"bert": "BertForMaskedLM", "funnel": ("FunnelModel", "FunnelBaseModel"), ...}.
ClassNames = Mapping[str, str | tuple[str, ...]]


@dataclass(frozen=True)
class TaskTables:
    """transformers' tables that say a checkpoint's task: read as text at compose (_table),
    imported from transformers by the model stage."""

    causal_lms: ClassNames
    masked_lms: ClassNames
    headless: ClassNames
    encoder_decoders: ClassNames
    image_classifiers: ClassNames
    speech_recognizers: ClassNames
    vision_lms: ClassNames


def task_of(directory: Path, model_type: object, saved_as: list[str], tables: TaskTables) -> HfTask:
    """The task of a checkpoint of `model_type` saved as the classes `saved_as`; ConfigError
    where model=hf takes none of them."""
    causal_lms = tables.causal_lms
    # AutoModelForCausalLM maps some encoders too (bert -> BertLMHeadModel); the architecture the
    # checkpoint was saved from says whether its weights hold a causal-LM head, or whether one
    # would be drawn at random.
    if model_type in causal_lms and (
        not saved_as or set(_names(causal_lms.values())).intersection(saved_as)
    ):
        return HfTask.causal_lm
    classifiers = tables.image_classifiers
    if (
        isinstance(model_type, str)
        and model_type in classifiers
        and set(_names([classifiers[model_type]])).intersection(saved_as)
    ):
        return HfTask.image_classification
    speech = tables.speech_recognizers
    if (
        model_type == "whisper"
        and model_type in speech
        and set(_names([speech[model_type]])).intersection(saved_as)
    ):
        return HfTask.speech_recognition
    vision = tables.vision_lms
    if (
        model_type in VISION_LM_TYPES
        and model_type in vision
        and set(_names([vision[model_type]])).intersection(saved_as)
    ):
        return HfTask.vision_lm
    # The masked-LM table holds encoder-decoders too (bart -> BartForConditionalGeneration),
    # whose inputs and outputs are a decoder's as well.
    if (
        isinstance(model_type, str)
        and model_type in tables.masked_lms
        and model_type not in tables.encoder_decoders
    ):
        if set(_names([tables.masked_lms[model_type]])).intersection(saved_as):
            return HfTask.masked_lm
        if set(_names([tables.headless.get(model_type, ())])).intersection(saved_as):
            return HfTask.encoder
    raise ConfigError(no_causal_lm_head(directory, model_type, saved_as))


def _names(entries: Iterable[str | tuple[str, ...]]) -> Iterator[str]:
    """Every class name of table entries, each one name or a tuple of them."""
    for entry in entries:
        yield from (entry,) if isinstance(entry, str) else entry


def gguf_file(checkpoint: Path) -> Path | None:
    """The GGUF file that `checkpoint` names: itself, or the one .gguf of a directory without a
    config.json; None for a directory written by save_pretrained()."""
    if checkpoint.is_file():
        return checkpoint
    if (checkpoint / CONFIG_FILE).is_file():
        return None
    found = sorted(checkpoint.glob(f"*{GGUF_SUFFIX}"))
    if len(found) > 1:
        raise ConfigError(
            f"model.checkpoint={checkpoint}: holds {len(found)} GGUF files "
            f"({', '.join(path.name for path in found)}); name one of them."
        )
    return found[0] if found else None


def check(checkpoint: Path) -> Architecture | None:
    """Refuses the checkpoint unless it is a causal LM, an encoder-only text model or an image
    classifier that transformers itself implements (model=hf runs no code shipped with a
    checkpoint): a save_pretrained() directory, or a GGUF file of an architecture transformers
    reads (causal LMs alone). Its architecture; None where transformers' tables cannot be read
    as text, and the model stage says."""
    gguf = gguf_file(checkpoint)
    if gguf is not None:
        return _check_gguf(gguf)
    directory = checkpoint
    config_file = directory / CONFIG_FILE
    if not config_file.is_file():
        raise ConfigError(
            f"model.checkpoint={directory}: not a Hugging Face checkpoint (no config.json and "
            f"no {GGUF_SUFFIX} file); point it at a directory written by save_pretrained() or "
            "at a GGUF file."
        )
    try:
        raw = json.loads(config_file.read_text())
    except (ValueError, OSError) as error:
        raise ConfigError(
            f"model.checkpoint={directory}: config.json is not JSON: {error}"
        ) from None
    if not isinstance(raw, dict):
        raise ConfigError(
            f"model.checkpoint={directory}: config.json holds a {type(raw).__name__}, not the "
            "object of a model's config."
        )
    architecture = _check_model_type(directory, raw)
    for weights in weight_files(directory):
        if weights.suffix == ".safetensors":
            _check_safetensors(directory, weights)
        else:
            _check_pickle(directory, weights)
    return architecture


def _check_model_type(directory: Path, raw: dict) -> Architecture | None:
    model_type = raw.get("model_type")
    configs, causal_lms = _table("configs"), _table("causal_lms")
    # Read from the file rather than left to AutoConfig, whose answer for these is an offer to
    # run the checkpoint's own Python (trust_remote_code=True) or to upgrade from the network.
    # gpt-sw3, a causal LM of GPT-2's config class, is the one type only the second table has.
    if configs is not None and model_type not in configs and model_type not in (causal_lms or {}):
        why = (
            "its config.json maps it to code shipped with the checkpoint (auto_map)"
            if "auto_map" in raw
            else "it would need code shipped with the checkpoint or another transformers"
        )
        raise ConfigError(
            f"model.checkpoint={directory}: model_type {model_type!r} is not one transformers "
            f"{importlib.metadata.version('transformers')} implements; {why}, and model=hf "
            "refuses remote code (trust_remote_code=False). Use a checkpoint of an "
            "architecture transformers ships."
        )
    tables = [_table(field.name) for field in fields(TaskTables)]
    if None in tables:
        return None
    saved_as = raw.get("architectures") or []
    return Architecture(task_of(directory, model_type, saved_as, TaskTables(*tables)), model_type)


def _check_gguf(path: Path) -> Architecture | None:
    if path.suffix != GGUF_SUFFIX:
        raise ConfigError(
            f"model.checkpoint={path}: a file that is not a {GGUF_SUFFIX}; model.checkpoint is "
            f"a GGUF file, or a directory written by save_pretrained()."
        )
    found = gguf_header.architecture(path)
    model_type = _GGUF_RENAMES.get(found, found)
    readable, causal_lms = _table("gguf"), _table("causal_lms")
    if readable is not None and model_type not in set(readable) - _GGUF_SECTIONS:
        known = sorted(set(readable) - _GGUF_SECTIONS)
        raise ConfigError(
            f"model.checkpoint={path}: its GGUF architecture {found!r} is not one transformers "
            f"{importlib.metadata.version('transformers')} loads from GGUF files; it loads "
            f"{', '.join(known)}."
        )
    if causal_lms is None:
        return None
    # transformers reads causal LMs alone from GGUF files.
    if model_type not in causal_lms:
        raise ConfigError(no_causal_lm_head(path, model_type, []))
    return Architecture(HfTask.causal_lm, model_type)


def no_causal_lm_head(directory: Path, model_type: object, saved_as: list[str]) -> str:
    architecture = f" (saved as {', '.join(saved_as)})" if saved_as else ""
    return (
        f"model.checkpoint={directory}: model_type {model_type!r}{architecture} has no "
        "causal-LM head and is no encoder-only text model, image classifier, Whisper or "
        "SmolVLM (an encoder-decoder, a headless decoder, another task's head, or another "
        "modality); model=hf exports causal LMs (AutoModelForCausalLM), encoder-only text "
        "models, saved with their masked-LM head (AutoModelForMaskedLM) or headless "
        "(AutoModel), image classifiers (AutoModelForImageClassification), Whisper "
        "(AutoModelForSpeechSeq2Seq) and SmolVLM (AutoModelForImageTextToText)."
    )


def weight_files(directory: Path) -> list[Path]:
    """The files transformers reads a save_pretrained() directory's weights from: safetensors
    before pickles, one file before an index of shards; none where the directory has none."""
    for single, index in (SAFETENSORS_FILES, PICKLE_FILES):
        if (directory / single).is_file():
            return [directory / single]
        if (directory / index).is_file():
            return _shards(directory, index)
    return []


def _shards(directory: Path, index: str) -> list[Path]:
    try:
        raw = json.loads((directory / index).read_text())
    except (ValueError, OSError) as error:
        raise ConfigError(f"model.checkpoint={directory}: {index} is not JSON: {error}") from None
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(name, str) for name in weight_map.values()
    ):
        raise ConfigError(
            f"model.checkpoint={directory}: {index} has no weight_map of tensor names to shard "
            "files; save the checkpoint again."
        )
    shards = [directory / name for name in sorted(set(weight_map.values()))]
    missing = [shard.name for shard in shards if not shard.is_file()]
    if missing:
        raise ConfigError(
            f"model.checkpoint={directory}: {index} names {len(missing)} shard files the "
            f"directory lacks ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})."
        )
    return shards


def _check_safetensors(directory: Path, file: Path) -> None:
    """Refuses a safetensors file unless it is what the safetensors package reads: a u64 length,
    a JSON object of that many bytes, then each tensor's bytes (its data_offsets, counted after
    the header) end to end, of its dtype and shape's size, to the file's end."""

    def corrupt(reason: str) -> ConfigError:
        return ConfigError(
            f"model.checkpoint={directory}: {file.name} is truncated or corrupt: {reason}; "
            "download or save the checkpoint again."
        )

    try:
        with file.open("rb") as stream:
            prefix = stream.read(8)
            if len(prefix) < 8:
                raise corrupt(f"it has {len(prefix)} bytes, fewer than its header's length takes")
            (length,) = struct.unpack("<Q", prefix)
            size = file.stat().st_size
            if length > min(size - 8, _SAFETENSORS_HEADER_LIMIT):
                raise corrupt(
                    f"its header's length is {length} bytes, and the file has {size - 8} after "
                    f"it (safetensors reads at most {_SAFETENSORS_HEADER_LIMIT})"
                )
            text = stream.read(length)
    except OSError as error:
        raise ConfigError(
            f"model.checkpoint={directory}: cannot read {file.name}: {error}"
        ) from None
    try:
        header = json.loads(text.decode())
    except (ValueError, RecursionError) as error:
        raise corrupt(f"its header is not JSON: {error}") from None
    if not isinstance(header, dict):
        raise corrupt("its header is not a JSON object")
    data_size = size - 8 - length
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        fields = entry if isinstance(entry, dict) else {}
        dtype, shape, offsets = (fields.get(k) for k in ("dtype", "shape", "data_offsets"))
        if not (
            dtype in _SAFETENSORS_BITS
            and _counts(shape)
            and _counts(offsets)
            and len(offsets) == 2
            and offsets[0] <= offsets[1]
        ):
            raise corrupt(f"tensor {name} lacks a dtype safetensors knows, a shape or offsets")
        begin, end = offsets
        if end > data_size:
            raise corrupt(
                f"tensor {name} needs bytes {begin} to {end} of the data, and the file holds "
                f"{data_size}"
            )
        bits = prod(shape) * _SAFETENSORS_BITS[dtype]
        if bits != (end - begin) * 8:
            raise corrupt(
                f"tensor {name} ({dtype} {shape}) takes {bits / 8:g} bytes, and its offsets "
                f"span {end - begin}"
            )
        spans.append((begin, end, name))
    reached = 0
    for begin, end, name in sorted(spans):
        if begin != reached:
            raise corrupt(f"tensor {name} starts at byte {begin} of the data, not {reached}")
        reached = end
    if reached != data_size:
        raise corrupt(
            f"its tensors end at byte {reached} of the data, and the file holds {data_size}"
        )


def _counts(value: object) -> bool:
    """Whether `value` is a JSON list of counts (ints from 0)."""
    return isinstance(value, list) and all(type(n) is int and n >= 0 for n in value)


def _check_pickle(directory: Path, file: Path) -> None:
    """Refuses a pickle of weights that imports a name torch.load(weights_only=True) does not
    allow: unpickling would call it. What a pickle imports is in its opcodes, read as data."""
    try:
        imported = next((name for name in _pickle_imports(file) if not _allowed_import(name)), None)
    except (
        ValueError,
        EOFError,
        NotImplementedError,
        zipfile.BadZipFile,
        zlib.error,
        # zipfile's refusal of an encrypted member.
        RuntimeError,
    ) as error:
        raise ConfigError(
            f"model.checkpoint={directory}: {file.name} is truncated or corrupt: it is no pickle "
            f"torch.save() wrote ({error}); download or save the checkpoint again."
        ) from None
    except OSError as error:
        raise ConfigError(
            f"model.checkpoint={directory}: cannot read {file.name}: {error}"
        ) from None
    if imported is not None:
        raise ConfigError(
            f"model.checkpoint={directory}: refused {file.name}: unpickling it would run code "
            f"(it imports {imported}, which no state dict holds); model=hf loads weights, never "
            "code. Use the checkpoint's safetensors weights (model.safetensors) instead."
        )


def _allowed_import(name: str) -> bool:
    # Protocol 2 (torch.save()'s) names the builtins module as Python 2 did, and torch.load reads
    # it as builtins.
    name = name.replace("__builtin__.", "builtins.", 1)
    # torch's own names pass here; torch.load(weights_only=True) allows only some of them, and
    # exporter/models/hf.py words its refusal of the others.
    return name.startswith("torch.") or name in _PICKLE_IMPORTS


def _pickle_imports(file: Path) -> Iterator[str]:
    """The names the pickles of a torch.save() file import (`module.name`): those of its zip
    archive's .pkl members, or the first pickles of the format before it."""
    size = file.stat().st_size
    if zipfile.is_zipfile(file):
        with zipfile.ZipFile(file) as archive:
            for member in archive.infolist():
                if not member.filename.endswith(".pkl"):
                    continue
                # zipfile reads a member in reads of up to its declared size: declared past the
                # archive's end, one would ask for more bytes than the file has.
                if member.header_offset + member.compress_size > size:
                    raise ValueError(f"{member.filename} ends past the archive's end")
                with archive.open(member) as stream:
                    yield from _imports(pickletools.genops(stream))
        return
    if size == 0:
        raise ValueError("it is empty")
    # Mapped: a read of the file would allocate the bytes an opcode declares, a read of the
    # mapping only those the file has.
    with file.open("rb") as stream, mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_READ) as data:
        for _ in range(_LEGACY_PICKLES):
            if data.tell() == size:
                return
            yield from _imports(pickletools.genops(data))


def _imports(opcodes: Iterator[tuple]) -> Iterator[str]:
    """What each opcode that imports names: GLOBAL and INST carry `module name`, STACK_GLOBAL
    takes the two strings pushed before it (a name computed otherwise is named so), EXT1, EXT2
    and EXT4 an entry of copyreg's registry."""
    pushed: deque[str | None] = deque(maxlen=2)
    for opcode, arg, _ in opcodes:
        if opcode.name in ("GLOBAL", "INST"):
            yield arg.replace(" ", ".", 1)
        elif opcode.name == "STACK_GLOBAL":
            known = len(pushed) == 2 and None not in pushed
            yield ".".join(pushed) if known else "a name the pickle computes"
        elif opcode.name.startswith("EXT"):
            yield f"copyreg's extension {arg}"
        if opcode.name not in _STACK_KEEPING_OPCODES:
            pushed.append(arg if opcode.name in _STRING_OPCODES else None)


@cache
def _table(name: str) -> dict[str, str] | None:
    """One of _TABLES, {model type: its entry}, or None where it cannot be read."""
    file_parts, variable = _TABLES[name]
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0], *file_parts)
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError):
        return None
    for node in tree.body:
        # VARIABLE = OrderedDict([("llama", "LlamaForCausalLM"), ...]) or VARIABLE = {...}
        if not (
            isinstance(node, ast.Assign)
            and [getattr(target, "id", None) for target in node.targets] == [variable]
        ):
            continue
        value = node.value
        if isinstance(value, ast.Call) and len(value.args) == 1:
            value = value.args[0]
        try:
            return dict(ast.literal_eval(value))
        except (ValueError, TypeError):
            return None
    return None
