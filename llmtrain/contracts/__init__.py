"""Contracts between the layers: what models and plans attach (`tags`), what building a model returns and how
the step loop lets a plan take part (`built`).

    python -m pytest tests/test_package_graph.py -q

This package imports nothing of llmtrain but `llmtrain.errors`: every layer may use it.
"""
