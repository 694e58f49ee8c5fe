"""The part of `--help` that conf/ knows: every config group a user chooses from, with its
options and the chosen one marked. conf/config.yaml's `hydra.help.template` takes it as
`${help_groups:}`; Hydra's own listing ($APP_CONFIG_GROUPS) would also list the schemas stored
under schema/ (exporter/command/schemas.py), which are not options.
"""

from __future__ import annotations

import textwrap

from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

RESOLVER = "help_groups"
# Top-level groups that are no choice of the user's: the schemas, and Hydra's own.
_NOT_OPTIONS = ("schema", "hydra")
# Hydra's group a user reaches for: how a sweep's jobs run.
_HYDRA_GROUPS = ("hydra/launcher",)
# A group whose option follows another's: what a user sets instead.
_INSTEAD = {"dynamic": "follows model; a dim's bounds: dynamic.seq.max=256, dynamic.batch.min=2"}
# Groups the defaults list leaves out: none is chosen unless `+group=option` adds one.
_ADDED = ("experiment",)
_WIDTH = 96


def groups() -> str:
    """A line per group (wrapped): `  model     custom, ..., llama*, ...`."""
    if not GlobalHydra.instance().is_initialized():
        # Resolved outside a command (the whole hydra node, in a test): no groups to list.
        return ""
    loader = GlobalHydra.instance().config_loader()
    choices = HydraConfig.get().runtime.choices if HydraConfig.initialized() else {}
    names = [name for name in loader.list_groups("") if name not in _NOT_OPTIONS]
    names += _HYDRA_GROUPS
    column = max(map(len, names)) + 4
    lines = []
    for name in names:
        options = loader.get_group_options(name)
        text = _INSTEAD.get(name) or ", ".join(
            f"{option}*" if option == choices.get(name) else option for option in options
        )
        if name in _ADDED:
            text = f"optional (+{name}=NAME): {text}"
        lines.append(
            textwrap.fill(
                text,
                _WIDTH,
                initial_indent=f"  {name}".ljust(column),
                subsequent_indent=" " * column,
                break_on_hyphens=False,
            )
        )
    return "\n".join(lines)


def register_resolver() -> None:
    """`${help_groups:}`; called by the command before Hydra composes."""
    OmegaConf.register_new_resolver(RESOLVER, groups, replace=True)
