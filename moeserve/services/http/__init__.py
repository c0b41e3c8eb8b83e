"""The OpenAI-compatible HTTP API: ``app`` (the Starlette app and its routes), ``params``
(parsing and validating OpenAI's parameters), ``choices`` (each choice's state), ``encode``
(JSON, errors, server-sent events), ``server`` (uvicorn, TLS)."""

from moeserve.services.http.app import HttpApi
from moeserve.services.http.server import HttpServer

__all__ = ["HttpApi", "HttpServer"]
