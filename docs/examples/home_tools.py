"""An example tool handler for ``edge voice --tools docs/examples/tools.json
--tool-handler home_tools:handle`` (run from docs/examples, or put it on PYTHONPATH)."""

from __future__ import annotations

LIGHTS: dict[str, dict] = {}


def handle(name: str, arguments: dict) -> dict:
    if name == "set_light":
        LIGHTS[arguments["room"]] = {"on": arguments["on"], "brightness": arguments.get("brightness", 100)}
        return {"ok": True, "room": arguments["room"], **LIGHTS[arguments["room"]]}
    if name == "next_charger":
        return {"name": "Mill road car park", "km": min(3, arguments["max_km"]), "free_connectors": 2}
    return {"error": f"unknown tool {name}"}
