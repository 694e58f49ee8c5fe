"""A Hugging Face checkpoint's config.json, checked when the job's config is composed: importing
transformers loads torch, seconds before a wrong checkpoint could be refused.

The model types transformers implements, and those of them AutoModelForCausalLM loads, are read
from transformers' own tables (models/auto/: auto_mappings.py, modeling_auto.py) as the data
they are, without importing it. Where a table cannot be read (another layout of transformers),
its check is left to the model stage (exporter/models/hf.py), which imports transformers.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
from functools import cache
from pathlib import Path

from exporter.errors import ConfigError

CONFIG_FILE = "config.json"
_TABLES = {
    # Every model type transformers has a config class for.
    "configs": ("auto_mappings.py", "CONFIG_MAPPING_NAMES"),
    # The model types AutoModelForCausalLM loads, each with its class.
    "causal_lms": ("modeling_auto.py", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
}


def check(directory: Path) -> None:
    """Refuses the checkpoint unless its config.json is one of a causal LM that transformers
    itself implements (model=hf runs no code shipped with a checkpoint)."""
    config_file = directory / CONFIG_FILE
    if not config_file.is_file():
        raise ConfigError(
            f"model.checkpoint={directory}: not a Hugging Face checkpoint (no config.json); "
            "point it at a directory written by save_pretrained()."
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


def no_causal_lm_head(directory: Path, model_type: object, saved_as: list[str]) -> str:
    architecture = f" (saved as {', '.join(saved_as)})" if saved_as else ""
    return (
        f"model.checkpoint={directory}: model_type {model_type!r}{architecture} has no "
        "causal-LM head (an encoder-only, encoder-decoder or headless model); model=hf exports "
        "causal LMs, the checkpoints AutoModelForCausalLM loads."
    )


@cache
def _table(name: str) -> dict[str, str] | None:
    """One of _TABLES, {model type: class name}, or None where it cannot be read."""
    file_name, variable = _TABLES[name]
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0], "models", "auto", file_name)
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError):
        return None
    for node in tree.body:
        # VARIABLE = OrderedDict([("llama", "LlamaForCausalLM"), ...])
        if (
            isinstance(node, ast.Assign)
            and [getattr(target, "id", None) for target in node.targets] == [variable]
            and isinstance(node.value, ast.Call)
            and len(node.value.args) == 1
        ):
            try:
                return dict(ast.literal_eval(node.value.args[0]))
            except (ValueError, TypeError):
                return None
    return None
