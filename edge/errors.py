"""Errors a request can meet in the engine, the scheduler or the sampler.

Torch-free, so the HTTP layer can map each class to its answer (edge/serving/errors.py)
without importing the engine. The modules that raise them re-export their names.
"""

from __future__ import annotations


class PromptTooLong(ValueError):
    """The prompt does not fit the context with room for one generated token."""


class InvalidPrompt(ValueError):
    """The prompt holds token ids outside the model's vocabulary (HTTP 400)."""


class SamplingError(ValueError):
    """Sampling parameters out of range; the message names the parameter."""


class ChatTemplateError(ValueError):
    """The model has no chat template, or the template rejected the conversation."""


class ImageError(ValueError):
    """An image a request sent cannot be used: a bad URL, undecodable, too large, too
    many, or of an extreme shape (HTTP 400 invalid_image)."""


class QueueFull(RuntimeError):
    """The bounded request queue is full (HTTP 429): retry later."""


class DuplicateRequestId(ValueError):
    """A request id that is still in flight was submitted again (HTTP 409)."""


class SchedulerStopped(RuntimeError):
    """The scheduler is stopping or stopped and takes no new requests (HTTP 503)."""
