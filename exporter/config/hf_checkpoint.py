"""A Hugging Face checkpoint, checked when the job's config is composed: importing transformers
loads torch, seconds before a wrong checkpoint could be refused. A checkpoint is a directory
written by save_pretrained() (its config.json says what it is), or a GGUF file, llama.cpp's
format, named itself or as the one .gguf of a directory without config.json (its header says
its architecture; transformers dequantizes its weights into a float model).

The model types transformers implements, those of them AutoModelForCausalLM loads, and the GGUF
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
from functools import cache
from pathlib import Path

from exporter.config import gguf_header
from exporter.errors import ConfigError

CONFIG_FILE = "config.json"
GGUF_SUFFIX = ".gguf"
_TABLES = {
    # Every model type transformers has a config class for.
    "configs": (("models", "auto", "auto_mappings.py"), "CONFIG_MAPPING_NAMES"),
    # The model types AutoModelForCausalLM loads, each with its class.
    "causal_lms": (("models", "auto", "modeling_auto.py"), "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
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


def check(checkpoint: Path) -> None:
    """Refuses the checkpoint unless it is a causal LM that transformers itself implements
    (model=hf runs no code shipped with a checkpoint): a save_pretrained() directory, or a GGUF
    file of an architecture transformers reads."""
    gguf = gguf_file(checkpoint)
    if gguf is not None:
        _check_gguf(gguf)
        return
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
    _check_model_type(directory, raw)


def _check_model_type(directory: Path, raw: dict) -> None:
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
    if causal_lms is None:
        return
    # AutoModelForCausalLM maps some encoders too (bert -> BertLMHeadModel); the architecture the
    # checkpoint was saved from says whether its weights hold a causal-LM head, or whether one
    # would be drawn at random.
    saved_as = raw.get("architectures") or []
    if model_type not in causal_lms or (
        saved_as and not set(causal_lms.values()).intersection(saved_as)
    ):
        raise ConfigError(no_causal_lm_head(directory, model_type, saved_as))


def _check_gguf(path: Path) -> None:
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
    if causal_lms is not None and model_type not in causal_lms:
        raise ConfigError(no_causal_lm_head(path, model_type, []))


def no_causal_lm_head(directory: Path, model_type: object, saved_as: list[str]) -> str:
    architecture = f" (saved as {', '.join(saved_as)})" if saved_as else ""
    return (
        f"model.checkpoint={directory}: model_type {model_type!r}{architecture} has no "
        "causal-LM head (an encoder-only, encoder-decoder or headless model); model=hf exports "
        "causal LMs, the checkpoints AutoModelForCausalLM loads."
    )


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
