"""Two-slot ping-pong scheduler: requests, streaming, cancel (barge-in), prefix reuse.

``policy`` decides (admission, slot states, prefix reuse), ``pacing`` sizes and spaces
background prefill chunks, ``executor`` does each decision's device work, ``streams``
holds the CUDA streams and events, ``loop`` is the thread with the callers' API
(``Scheduler``), ``request`` is what callers hold.
"""

from edge.scheduling.loop import Scheduler
from edge.scheduling.policy import SlotState
from edge.scheduling.request import InvalidPrompt, QueueFull, RequestHandle

__all__ = ["InvalidPrompt", "QueueFull", "RequestHandle", "Scheduler", "SlotState"]
