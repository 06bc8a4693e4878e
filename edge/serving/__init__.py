"""The OpenAI-compatible HTTP layer: parse a request, submit it, stream the answer.

``app`` builds the FastAPI application over a :class:`edge.serving.service.Service`;
``completions`` runs parse -> prompt -> submit -> stream; ``prompts`` renders and
tokenizes off the event loop; ``guard`` checks Host, Content-Type and CORS;
``errors`` maps every error class to its HTTP status and OpenAI body in one table.
"""
