"""Two-slot ping-pong scheduler: requests, streaming, cancel (barge-in), prefix reuse."""

from edge.scheduler.request import InvalidPrompt, QueueFull, RequestHandle
from edge.scheduler.scheduler import Scheduler, SlotState

__all__ = ["InvalidPrompt", "QueueFull", "RequestHandle", "Scheduler", "SlotState"]
