"""Errors the framework raises to its users."""


class PipelineError(Exception):
    """Base class of the framework's own errors."""


class BuildError(PipelineError, ValueError):
    """A graph or its configuration cannot be built; the message names what and where."""


class PipelineClosed(PipelineError, RuntimeError):
    """Work was submitted to a pipeline that is closing or closed."""
