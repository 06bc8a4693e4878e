"""Two-slot ping-pong scheduler: requests, streaming, cancel (barge-in), prefix reuse.

``policy`` decides (admission, slot states, prefix reuse), ``pacing`` sizes and spaces
background prefill chunks, ``streams`` holds the CUDA streams and events, ``loop`` runs
the engine on its thread, ``request`` is what callers hold.
"""

from edge.scheduler.loop import Scheduler
from edge.scheduler.policy import SlotState
from edge.scheduler.request import InvalidPrompt, QueueFull, RequestHandle

__all__ = ["InvalidPrompt", "QueueFull", "RequestHandle", "Scheduler", "SlotState"]
