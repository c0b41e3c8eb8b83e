"""The leader's engine: its typed API (``api``), the engine (``leader``), continuous batching
(``scheduler``), live migration (``migration``) and the local channel other processes reach it
through (``channel``). Import the module you need; this package imports nothing at start."""
