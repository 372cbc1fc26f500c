"""Serving on Ray Serve: engine replicas behind one OpenAI-compatible endpoint.

``policy`` and ``config`` import neither Ray nor torch; the rest needs ``llmserve[ray]``.
"""
