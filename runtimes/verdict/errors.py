"""How running an artifact under the verdict fails."""


class ArtifactFailed(Exception):
    """The artifact raised at an execution, or returned another number of outputs than the
    model's."""
