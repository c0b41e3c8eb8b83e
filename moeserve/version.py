"""moeserve's version, in a module of its own: the CLI and the HTTP server read it without
importing the package's face (``moeserve/__init__.py``, which hands on vLLM's offline API)."""

__version__ = "0.1.0"
