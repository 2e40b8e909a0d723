"""``apir serve``: an OpenAI-compatible (and Ollama-compatible) HTTP server for one model.

Needs the ``serve`` extra (Starlette, uvicorn, llguidance); nothing here is imported by the rest of
apir, so guests without it lose only this command. Entry points: ``cli.add_parser`` for
the command line, ``app.create_app`` for an ASGI app.
"""
