"""Models: see moe.py for the router/expert seam."""
